"""Token sampling over a batch of logits: temperature, top-k, top-p, per-row seeds (counter-based:
a seeded row's random number is a pure function of its seed and draw index, `row_uniforms`).

Pure tensor code with no model or engine state, so the rollout engine and tests share one
definition of "the distribution a token was drawn from". The log-prob returned for each token
is taken under exactly that distribution, because RL losses compare it with the trainer's
log-probs of the same token.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tidal.contracts import SamplingParams  # the request record of the engine contract
from tidal.engine import native, sample_kernel
from tidal.hardware import CPU, host_values

log = logging.getLogger(__name__)

__all__ = ["SamplingParams", "SamplingPlan", "row_uniforms", "sample_planned", "sample_tokens"]


def _per_row(value: Tensor | float | int, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Broadcast a scalar or [B] parameter to a [B] tensor on the logits' device."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"per-row sampling parameter must have shape ({batch},), got {tuple(t.shape)}")
    return t


# splitmix64's constants (Steele, Lea and Flood, 2014), as the signed int64 torch computes in
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_SEED_SALT = 0x5851F42D4C957F2D  # keeps mix(seed) away from the stream's own steps of gamma


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's `>>` on int64 is arithmetic: it copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 (multiplications wrap modulo 2**64, as the integers do on
    every device torch runs on): a bijection whose every output bit depends on every input bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def row_uniforms(seeds: Tensor, draws: Tensor) -> Tensor:
    """Uniform[0, 1) numbers, one per row, each a pure function of its row's seed and draw index:

        u = top 24 bits of mix(mix(seed ^ salt) + (draw + 1) * gamma) / 2**24      (float32)

    the `draw`-th number of splitmix64's stream started from the scrambled seed (`seeds`, `draws`:
    int64 [N] on any device). A counter-based generator, as Philox is in cuRAND: no per-row state
    to carry between steps and nothing read back to the host, so a batch's numbers are a few
    elementwise kernels on the logits' device. Scrambling the seed first matters: the rollout
    derives a sample's later seeds by adding multiples of gamma (`turn_seed`), which would
    otherwise make one turn's stream the previous turn's shifted by one."""
    state = _mix(seeds ^ _SEED_SALT) + (draws + 1) * _GAMMA
    return _shr(_mix(state), 40).to(torch.float32) * (1.0 / (1 << 24))


def _uniforms(plan: SamplingPlan, draws: Tensor | Sequence[int] | None, rows: Tensor) -> Tensor:
    """One Uniform[0, 1) number per sampled row ([len(rows)]).

    A seeded row's number is `row_uniforms(seed, draws)`: its samples depend only on its own seed
    and how many tokens it has drawn so far (`draws`, default 0), never on the other rows of the
    batch. Unseeded rows draw from torch's global generator."""
    batch, device = plan.rows.temp.shape[0], plan.rows.temp.device
    u = torch.rand(rows.numel(), device=device)
    if plan.seeds is None:
        return u
    draw_t = _draw_indices(draws, batch, device)
    mine = row_uniforms(plan.seeds[rows], draw_t[rows])
    if plan.seeded is None:
        return mine
    return torch.where(plan.seeded[rows], mine, u)


def _draw_indices(draws: Tensor | Sequence[int] | None, batch: int, device: torch.device) -> Tensor:
    """Each row's draw index as a [batch] int64 tensor on `device` (None: 0 for every row)."""
    if draws is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    draw_t = draws.to(device, torch.long) if isinstance(draws, Tensor) else host_values(draws, torch.long, device)
    if draw_t.shape != (batch,):
        raise ValueError(f"draws must have one entry per row ({batch}), got shape {tuple(draw_t.shape)}")
    return draw_t


def _inverse_cdf(probs: Tensor, u: Tensor, chunk: int = 256) -> Tensor:
    """For each row, the first index whose cumulative probability exceeds u * (total mass).

    Two levels, so no cumulative sum runs over the whole vocabulary: pick the chunk of `chunk`
    tokens whose cumulative chunk mass first exceeds the target, then the token inside it. A
    zero-probability token is never returned (rounding at either level falls back to the chunk's
    last token with non-zero probability)."""
    b, v = probs.shape
    pad = (-v) % chunk
    p = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(b, -1, chunk)
    chunk_cdf = p.sum(dim=-1).cumsum(dim=-1)  # [B, V / chunk]
    total = chunk_cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    ci = torch.searchsorted(chunk_cdf, target[:, None], right=True)[:, 0].clamp(max=chunk_cdf.shape[1] - 1)
    before = torch.where(ci > 0, chunk_cdf.gather(1, (ci - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(total))
    inner = p[torch.arange(b, device=probs.device), ci]  # [B, chunk]
    ti = torch.searchsorted(inner.cumsum(dim=-1), (target - before).clamp(min=0)[:, None], right=True)[:, 0]
    last_nonzero = chunk - 1 - (inner > 0).flip(-1).int().argmax(dim=-1)
    return ci * chunk + torch.minimum(ti, last_nonzero)


@dataclass
class _RowPlan:
    """A batch's sampling parameters as [B] tensors on the logits' device, and what the draw needs
    to know of them as Python values: which rows are greedy, whether a sampled row is tempered
    (T != 1) or filtered (top-k, top-p or min-p keeps only some tokens).

    Made from Python numbers or lists (the engine's case: `of` reads the flags from them, so the
    step reads nothing back from the device) or from tensors (the flags are then read back)."""

    temp: Tensor
    top_p: Tensor
    top_k: Tensor
    min_p: Tensor
    greedy_rows: Tensor
    sampled_rows: Tensor
    n_greedy: int
    tempered: bool
    filtered: bool

    @staticmethod
    def of(temperature, top_p, top_k, min_p, batch: int, vocab: int, device: torch.device) -> _RowPlan:
        values = (temperature, top_p, top_k, min_p)
        if any(isinstance(v, Tensor) for v in values):
            host = [_per_row(v, batch, dt, CPU).tolist() for v, dt in zip(values, _DTYPES, strict=True)]
        else:
            host = [_host_row(v, batch) for v in values]
        t, p, k, mp = host
        if any(x < 0 for x in t) or any(not 0 < x <= 1 for x in p) or any(x < 0 for x in k):
            raise ValueError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0 in every row")
        if any(not 0 <= x <= 1 for x in mp):
            raise ValueError("need 0 <= min_p <= 1 in every row")
        greedy = [i for i in range(batch) if t[i] == 0]
        sampled = [i for i in range(batch) if t[i] != 0]
        tensors = [host_values(v, dt, device) for v, dt in zip(host, _DTYPES, strict=True)]
        return _RowPlan(
            *tensors,
            greedy_rows=host_values(greedy, torch.long, device),
            sampled_rows=host_values(sampled, torch.long, device),
            n_greedy=len(greedy),
            tempered=any(t[i] != 1 for i in sampled),
            filtered=any(0 < k[i] < vocab or p[i] < 1 or mp[i] > 0 for i in sampled),
        )


_DTYPES = (torch.float32, torch.float32, torch.long, torch.float32)  # temperature, top_p, top_k, min_p


@dataclass
class SamplingPlan:
    """A batch's sampling parameters on the device (`rows`) and its rows' seeds: made once per
    batch, and reused while the batch's rows and their parameters stay the same (the engine's
    overlapped decode steps), so a step copies nothing of them to the device again."""

    rows: _RowPlan
    seeds: Tensor | None  # [B] long on the device, 0 for an unseeded row; None: no row is seeded
    seeded: Tensor | None  # [B] bool on the device; None: every row is seeded, or none

    @staticmethod
    def of(
        logits: Tensor,
        temperature: Tensor | float | Sequence[float],
        top_p: Tensor | float | Sequence[float],
        top_k: Tensor | int | Sequence[int],
        seeds: Sequence[int | None] | None = None,
        min_p: Tensor | float | Sequence[float] = 0.0,
    ) -> SamplingPlan:
        """The plan for `logits` [B, V] (`sample_tokens` says what each parameter means)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must have shape [B, V], got {tuple(logits.shape)}")
        batch, vocab = logits.shape
        device = logits.device
        rows = _RowPlan.of(temperature, top_p, top_k, min_p, batch, vocab, device)
        if seeds is None:
            return SamplingPlan(rows, None, None)
        if len(seeds) != batch:
            raise ValueError(f"seeds must have one entry per row ({batch}), got {len(seeds)}")
        seeded = [s is not None for s in seeds]
        if not any(seeded):
            return SamplingPlan(rows, None, None)
        seed_t = host_values([s if s is not None else 0 for s in seeds], torch.long, device)
        return SamplingPlan(rows, seed_t, None if all(seeded) else host_values(seeded, torch.bool, device))


def _host_row(value: float | int | Sequence, batch: int) -> list:
    """A scalar or per-row parameter given as Python values, as a list of `batch` values."""
    if isinstance(value, int | float):
        return [value] * batch
    values = list(value)
    if len(values) != batch:
        raise ValueError(f"per-row sampling parameter must have shape ({batch},), got ({len(values)},)")
    return values


@torch.no_grad()
def sample_tokens(
    logits: Tensor,
    temperature: Tensor | float | Sequence[float],
    top_p: Tensor | float | Sequence[float],
    top_k: Tensor | int | Sequence[int],
    seeds: Sequence[int | None] | None = None,
    min_p: Tensor | float | Sequence[float] = 0.0,
    draws: Tensor | Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of `logits` [B, V].

    Parameters may be scalars, per-row lists or per-row [B] tensors, so one batch can mix requests.
    Given as Python values (the engine's case), nothing is read back from the logits' device to
    decide how to draw (on a GPU a read-back stalls the host until the device catches up).
    Rows with temperature 0 are greedy: the token is the argmax and its log-prob comes from the
    plain softmax of the raw logits. Other rows divide the logits by the temperature, keep the
    `top_k` most likely tokens (0 = all), then keep the smallest set of most likely tokens whose
    probability sums to at least `top_p` (always at least one token), drop tokens whose tempered
    probability is below `min_p` times the most likely token's, and sample from what is left,
    renormalised. `seeds[i]`, when given and not None, is the only randomness used for row i: its
    token is drawn with `row_uniforms(seeds[i], draws[i])`, `draws[i]` being how many tokens the
    row has drawn before (0 when `draws` is not given).

    Returns `(tokens [B] long, log_probs [B] float32)`, where each log-prob is that of the chosen
    token under the exact (tempered, filtered, renormalised) distribution it was drawn from.

    Every row sampled at a temperature > 0 without filtering (the RL rollout's case), on a CPU:
    the same draw by `tidal.engine.native.sample`, which reads float32 or bfloat16 logits in place.
    """
    return sample_planned(logits, SamplingPlan.of(logits, temperature, top_p, top_k, seeds, min_p), draws)


@torch.no_grad()
def sample_planned(
    logits: Tensor, sampling: SamplingPlan, draws: Tensor | Sequence[int] | None = None, kernel: bool = True
) -> tuple[Tensor, Tensor]:
    """`sample_tokens` with its parameters as a `SamplingPlan` made before (for these rows).
    `kernel`: on a GPU, rows sampled at a temperature > 0 without filters are drawn by
    `tidal.engine.sample_kernel` in one launch where it passed its check (False: torch's ops)."""
    batch, vocab = logits.shape
    device = logits.device
    plan = sampling.rows
    if plan.temp.shape[0] != batch:
        raise ValueError(f"the sampling plan has {plan.temp.shape[0]} rows; the logits have {batch}")
    temp, p, k, mp = plan.temp, plan.top_p, plan.top_k, plan.min_p
    if not plan.filtered and plan.n_greedy == 0:
        if native.can_sample(logits):
            return native.sample(logits, temp, _uniforms(sampling, draws, torch.arange(batch, device=device)))
        if kernel and _kernel_usable(logits):
            return _kernel_draw(logits, sampling, draws)
    # float32 throughout: bf16/fp16 softmax and cumsum are too coarse for top-p and for log-probs.
    logits = logits.float()

    tokens = torch.empty(batch, dtype=torch.long, device=device)
    log_probs = torch.empty(batch, dtype=torch.float32, device=device)

    if plan.n_greedy:
        g_rows = plan.greedy_rows
        g_logits = logits[g_rows]
        g_tok = g_logits.argmax(dim=-1)
        tokens[g_rows] = g_tok
        log_probs[g_rows] = torch.log_softmax(g_logits, dim=-1).gather(-1, g_tok[:, None])[:, 0]

    if plan.n_greedy == batch:
        return tokens, log_probs

    rows = plan.sampled_rows
    # skip the copies the common RL case (every row sampled at temperature 1) does not need
    scaled = logits if plan.n_greedy == 0 else logits[rows]
    if plan.tempered:
        scaled = scaled / temp[rows, None]
    rk = k[rows]
    rp = p[rows]
    rmp = mp[rows]
    if plan.filtered:
        # Filter in sorted order, then scatter the keep-mask back to vocab order: the draw then
        # walks the vocabulary in id order, so a seeded row does not depend on sort tie-breaking.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        pos = torch.arange(vocab, device=device)
        k_eff = torch.where(rk > 0, rk.clamp(max=vocab), torch.full_like(rk, vocab))
        keep_sorted = pos[None, :] < k_eff[:, None]
        # top-p acts on the distribution left after top-k, renormalised.
        probs_k = torch.softmax(sorted_logits.masked_fill(~keep_sorted, -math.inf), dim=-1)
        mass_before = probs_k.cumsum(dim=-1) - probs_k
        # A token is kept while the mass strictly above it is still short of top_p; this is the
        # smallest prefix reaching top_p. top_p == 1 keeps everything (no float-rounding losses).
        keep_p = (mass_before < rp[:, None]) | (rp[:, None] >= 1)
        keep_sorted = keep_sorted & keep_p
        # min-p on the tempered distribution: p_v >= min_p * p_max <=> z_v >= z_max + log(min_p)
        min_logit = sorted_logits[:, :1] + torch.log(rmp.clamp_min(1e-30))[:, None]
        keep_sorted &= (rmp[:, None] <= 0) | (sorted_logits >= min_logit)
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        scaled = scaled.masked_fill(~keep, -math.inf)

    # Inverse-CDF sampling: the first token whose cumulative probability exceeds u. One uniform
    # per row instead of a vocabulary's worth of noise (Gumbel-max costs two logs per entry).
    probs = torch.softmax(scaled, dim=-1)
    s_tok = _inverse_cdf(probs, _uniforms(sampling, draws, rows))
    tokens[rows] = s_tok
    # the log-prob under the distribution drawn from (tempered, filtered, renormalised)
    log_probs[rows] = torch.log(probs.gather(-1, s_tok[:, None])[:, 0])
    return tokens, log_probs


_kernel_checked: dict[torch.device, bool] = {}


def _kernel_usable(logits: Tensor) -> bool:
    """Whether `sample_planned` draws these logits with `sample_kernel`: on a GPU with Triton (or
    in its interpreter, where a test asks for it), float32 or bfloat16, once `kernel_check`
    passed on this device."""
    device = logits.device
    if not sample_kernel.runs_on(device) or logits.dtype not in (torch.float32, torch.bfloat16):
        return False
    if device not in _kernel_checked:
        why = kernel_check(device)
        if why:
            log.warning("the sampling kernel is off (torch's ops draw): %s", why)
        _kernel_checked[device] = why is None
    return _kernel_checked[device]


def kernel_check(device: torch.device) -> str | None:
    """Draw 64 seeded rows of a 1,003-token vocabulary with `sample_kernel` and with torch's ops:
    None where the tokens agree and the log-probs are within 1e-5, else why not."""
    gen = torch.Generator(device=CPU).manual_seed(0)
    b, v = 64, 1003
    logits = (torch.randn(b, v, generator=gen, device=CPU) * 3).to(device)
    temp = torch.linspace(0.3, 1.7, b).to(device)
    seeds = torch.arange(100, 100 + b, device=device)
    draws = torch.arange(b, device=device) * 7
    try:
        tok, lp = sample_kernel.draw(logits, temp, torch.zeros(b, device=device), seeds, None, draws)
    except Exception as e:  # a Triton or driver that cannot build it: say why, keep torch's ops
        return f"{type(e).__name__}: {e}"
    plan = SamplingPlan(_RowPlan.of(temp.tolist(), 1.0, 0, 0.0, b, v, device), seeds, None)
    want_tok, want_lp = sample_planned(logits, plan, draws, kernel=False)
    if not torch.equal(tok, want_tok):
        return f"its tokens differ from torch's on {int((tok != want_tok).sum())} of {b} rows"
    gap = float((lp - want_lp).abs().max())
    if gap > 1e-5:
        return f"its log-probs differ from torch's by up to {gap:.3g}"
    return None


def _kernel_draw(logits: Tensor, sampling: SamplingPlan, draws: Tensor | Sequence[int] | None) -> tuple[Tensor, Tensor]:
    """`sample_kernel.draw` with the plan's seeds and the rows' draw indices (`_uniforms`' inputs)."""
    batch, device = logits.shape[0], logits.device
    all_seeded = sampling.seeds is not None and sampling.seeded is None
    u = sampling.rows.temp if all_seeded else torch.rand(batch, device=device)  # no unseeded row reads it
    draw_t = _draw_indices(draws, batch, device)
    return sample_kernel.draw(logits, sampling.rows.temp, u, sampling.seeds, sampling.seeded, draw_t)


@torch.no_grad()
def scored_log_probs(logits: Tensor, tokens: Tensor, rows: _RowPlan, drawn: Tensor) -> Tensor:
    """Each row's log-prob of its token as a trainer scores it: log_softmax(float32(z) / t)[token]
    (t the row's temperature; 1 for a greedy row), where `drawn` [B] are the log-probs the draw
    reported (which may sum and round in another order). Rows sampled with a filter (top-k, top-p,
    min-p) keep `drawn`, their renormalised distribution's, which no trainer's forward knows."""
    t = torch.where(rows.temp > 0, rows.temp, torch.ones_like(rows.temp))
    z = logits.float()
    if rows.tempered:  # greedy rows divide by 1: the same bits
        z = z / t[:, None]
    scored = torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None].long())[:, 0]
    if not rows.filtered:
        return scored
    vocab = logits.shape[1]
    plain = (rows.temp == 0) | (((rows.top_k == 0) | (rows.top_k >= vocab)) & (rows.top_p >= 1) & (rows.min_p <= 0))
    return torch.where(plain, scored, drawn)


def adjust_logits(logits: Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]) -> Tensor:
    """Apply each row's repetition, presence and frequency penalties over the tokens it has
    generated so far (`outputs[i]`), and its logit bias; rows without any are left as they are.
    Returns `logits` itself when no row adjusts, else an adjusted float32 copy.

        z_v <- z_v / r if z_v > 0 else z_v * r        (repetition_penalty r, for v already generated)
        z_v <- z_v - presence * [c_v > 0] - frequency * c_v + bias_v     (c_v: count of v so far)
    """
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.to(torch.float32, copy=True)
    vocab = logits.shape[1]
    for i in rows:
        p, z = params[i], logits[i]
        if outputs[i]:
            ids, counts = torch.tensor(outputs[i], dtype=torch.long, device=z.device).unique(return_counts=True)
            if p.repetition_penalty != 1.0:
                seen = z[ids]
                z[ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
            z[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(z.dtype)
        if p.logit_bias:
            ids = torch.tensor([k for k in p.logit_bias if k < vocab], dtype=torch.long, device=z.device)
            vals = torch.tensor([p.logit_bias[k] for k in p.logit_bias if k < vocab], dtype=z.dtype, device=z.device)
            z[ids] += vals
    return logits


def top_logprobs(logits: Tensor, temperature: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The `k` most likely tokens of each row of softmax(logits / T) and their log-probs
    ([B, k] ids, [B, k] log-probs); greedy rows (T = 0) use T = 1."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits.device)
    lp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    vals, ids = lp.topk(k, dim=-1)
    return ids, vals
