"""Batch-invariant numerics (`tidal.invariant`): a row's products and a query's attention do not
depend on the rest of the call, and with `engine.batch_invariant` and `train.batch_invariant` the
trainer's log-probs are the engine's bit for bit, in bf16 as in fp32."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import loop_config, make_model
from families import tiny_model

import tidal.loop
from tidal import invariant
from tidal.algo.options import AlgoConfig
from tidal.attend import attend as attend32
from tidal.attend import causal_mask
from tidal.config import build_config
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.options import ConfigError
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.types import Sample

DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 128), (576, 1536), (1536, 576)])
def test_a_rows_product_has_the_same_bits_alone_and_anywhere_in_any_batch(dtype, shape):
    k, n = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    row = torch.randn(1, k, generator=gen).to(dtype)
    alone = invariant.linear(row, w, b)
    assert torch.equal(alone, F.linear(torch.cat([row, row.new_zeros(invariant.ROWS - 1, k)]), w, b)[:1])
    for m in (2, 3, 5, 16, 17, 33, 70):
        for at in {0, m // 2, m - 1}:
            x = torch.randn(m, k, generator=gen).to(dtype)
            x[at] = row[0]
            assert torch.equal(invariant.linear(x, w, b)[at], alone[0]), (m, at)
    # leading dimensions are kept
    assert invariant.linear(torch.stack([row, row]), w, b).shape == (2, 1, n)


def test_under_numerics_every_linear_layer_goes_through_the_padded_product_on_this_thread_only(monkeypatch):
    import threading

    seen = []
    real = invariant.linear

    def spy(x, weight, bias=None):
        seen.append((threading.current_thread().name, x.shape[0]))
        return real(x, weight, bias)

    monkeypatch.setattr(invariant, "linear", spy)
    lin = torch.nn.Linear(8, 4)
    other = threading.Thread(target=lambda: lin(torch.ones(2, 8)), name="other")
    with invariant.numerics():
        assert invariant.active()
        out = lin(torch.ones(3, 8))
        other.start()
        other.join()
    assert not invariant.active()
    lin(torch.ones(3, 8))
    assert seen == [(threading.current_thread().name, 3)]  # not the other thread's, nor after the mode
    assert torch.equal(out, real(torch.ones(3, 8), lin.weight, lin.bias))


def test_a_machine_whose_products_vary_by_position_is_refused_by_name(monkeypatch):
    real = F.linear

    def by_position(x, weight, bias=None):  # a kernel whose bits depend on where a row sits
        y = real(x, weight, bias)
        return y + torch.arange(y.shape[0], dtype=y.dtype)[:, None] * 1e-3

    monkeypatch.setattr(invariant, "_checked", set())
    monkeypatch.setattr(invariant.F, "linear", by_position)
    with pytest.raises(invariant.RowsVary, match=r"torch.float32 matrix products of shape \[\*, 8\] x \[8, 4\]"):
        invariant.linear(torch.ones(2, 8), torch.ones(4, 8))


def _qkv(gen, b, h, hkv, lq, lk, d, dtype):
    q = torch.randn(b, h, lq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,window", [(None, None), (30.0, None), (None, 5)])
def test_a_querys_attention_is_the_same_alone_with_more_masked_keys_and_beside_other_queries(dtype, softcap, window):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen, 3, 4, 2, 12, 12, 16, dtype)
    scale = 16**-0.5
    whole = invariant.attend(q, k, v, causal_mask(12, 12, 0, window), scale, softcap)  # [3, 4, 12, 16]
    for pos in (0, 4, 11):
        # the query at `pos` alone, over only its keys (as an engine's decode step computes it)
        keys = slice(0, pos + 1)
        mask = causal_mask(1, pos + 1, pos, window)
        alone = invariant.attend(q[1:2, :, pos : pos + 1], k[1:2, :, keys], v[1:2, :, keys], mask, scale, softcap)
        assert torch.equal(alone[0, :, 0], whole[1, :, pos])
        # and padded with keys nobody sees (another sample's longer row)
        pad = torch.randn(1, 2, 20, 16, generator=gen).to(dtype)
        kp, vp = torch.cat([k[1:2, :, keys], pad], 2), torch.cat([v[1:2, :, keys], pad], 2)
        mask = torch.cat([causal_mask(1, pos + 1, pos, window), torch.zeros(1, 20, dtype=torch.bool)], 1)
        padded = invariant.attend(q[1:2, :, pos : pos + 1], kp, vp, mask, scale, softcap)
        assert torch.equal(padded[0, :, 0], whole[1, :, pos])
    # the value is the formula's: within float32's rounding of the float32 computation
    ref = attend32(q.float(), k.float(), v.float(), causal_mask(12, 12, 0, window), scale, softcap)
    torch.testing.assert_close(whole.float(), ref, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_attentions_gradients_are_the_float32_formulas(softcap):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (x.requires_grad_() for x in _qkv(gen, 2, 4, 2, 7, 7, 8, torch.float32))
    mask = causal_mask(7, 7, 0, None)
    g = torch.randn(2, 4, 7, 8, generator=gen)
    got = torch.autograd.grad(invariant.attend(q, k, v, mask, 0.3, softcap), (q, k, v), g)
    want = torch.autograd.grad(attend32(q, k, v, mask, 0.3, softcap), (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # a bf16 input gets its gradient in bf16
    qb = q.detach().bfloat16().requires_grad_()
    (gq,) = torch.autograd.grad(invariant.attend(qb, k.detach().bfloat16(), v.detach().bfloat16(), mask, 0.3).sum(), qb)
    assert gq.dtype == torch.bfloat16


def _rollout(model_dir, dtype: str, requests: int = 12, **engine):
    """12 requests (pairs sharing a prompt; ragged prompts and limits; temperatures 1 and 0.7)
    through an engine that runs at most 5 at once, so each decode step mixes other sequences."""
    rng = random.Random(0)
    prompts = []
    for _ in range(requests // 2):
        p = [1] + [rng.randrange(3, 300) for _ in range(rng.randrange(3, 20))]
        prompts += [p, p]
    params = [
        SamplingParams(temperature=(1.0, 0.7)[i % 2], max_new_tokens=rng.randrange(5, 30), seed=i)
        for i in range(len(prompts))
    ]
    eng = LLMEngine(str(model_dir), dtype=dtype, kv_cache_tokens=4096, max_num_seqs=5, **engine)
    return prompts, params, eng.generate_batch(prompts, params)


def _scores_bit_for_bit(model, dtype: str, rollout, temps=(1.0, 0.7), device="cpu") -> None:
    """The trainer (`train.batch_invariant`) scores each sample of `rollout` at its temperature
    with exactly the engine's log-probs."""
    prompts, params, outs = rollout
    for temp in temps:
        rows = [i for i, sp in enumerate(params) if sp.temperature == temp]
        samples = [
            Sample(
                tokens=prompts[i] + outs[i].token_ids,
                response_length=len(outs[i].token_ids),
                loss_mask=[1] * len(outs[i].token_ids),
                rollout_log_probs=outs[i].log_probs,
                index=i,
            )
            for i in rows
        ]
        train = TrainConfig(dtype=dtype, batch_invariant=True, micro_batch_size=4, global_batch_size=8)
        actor = Actor(copy.deepcopy(model), train, AlgoConfig(), temperature=temp, device=device)
        scored = actor.compute_log_probs(samples).cpu()
        for j, s in enumerate(samples):
            want = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
            assert torch.equal(scored[j, : s.response_length], want), (temp, j)


@pytest.mark.parametrize("family", sorted(invariant.FAMILIES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_trainer_scores_the_engines_tokens_with_the_engines_log_probs_bit_for_bit(family, dtype, tmp_path):
    model = tiny_model(family)  # windows, biases, q/k norms, soft-capping, partial rotary, post-norms
    model.save_pretrained(tmp_path)
    _scores_bit_for_bit(model, dtype, _rollout(tmp_path, dtype, batch_invariant=True))


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(tmp_path):
    make_model().save_pretrained(tmp_path)
    prompts, params, outs = _rollout(tmp_path, "bfloat16", batch_invariant=True)
    eng = LLMEngine(str(tmp_path), dtype="bfloat16", kv_cache_tokens=4096, batch_invariant=True)
    for i in (0, 5, 11):
        (alone,) = eng.generate_batch([prompts[i]], [params[i]])
        assert alone.token_ids == outs[i].token_ids and alone.log_probs == outs[i].log_probs


@pytest.mark.parametrize("checkpointing", [False, "full", "selective"])
def test_a_bf16_grpo_run_trains_on_the_engines_log_probs_exactly(checkpointing, tiny_model_dir, tmp_path):
    over = {
        "train.gradient_checkpointing": checkpointing,
        "train.dtype": "bfloat16",
        "engine.dtype": "bfloat16",
        "train.batch_invariant": True,
        "engine.batch_invariant": True,
        "train.num_steps": 2,
        "train.global_batch_size": 16,  # one optimizer step per rollout: scored by the sampling weights
    }
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    assert [h["actor/rollout_logprob_abs_diff"] for h in history] == [0.0, 0.0]
    assert history[0]["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    "over,message",
    [
        (
            {"train.batch_invariant": True},
            "train.batch_invariant: the trainer's log-probs equal the engine's only when both compute under "
            "batch-invariant numerics; set engine.batch_invariant too",
        ),
        (
            {"engine.batch_invariant": True, "engine.kind": "hf"},
            "engine.batch_invariant: tidal's engine computes under batch-invariant numerics; engine.kind hf does not",
        ),
        (
            {"engine.batch_invariant": True, "engine.quantization": "int8"},
            "engine.batch_invariant: the trainer computes full-precision layers, so engine.quantization must be "
            "none, got 'int8'",
        ),
        (
            {"engine.batch_invariant": True, "train.batch_invariant": True, "train.dtype": "autocast"},
            "train.batch_invariant: scores in the weights' dtype as the engine does; train.dtype autocast casts "
            "per op (use auto, bfloat16 or float32)",
        ),
        (
            {"engine.batch_invariant": True, "train.batch_invariant": True, "train.lora_rank": 4},
            "train.batch_invariant: the engine runs merged LoRA weights, which round otherwise than the "
            "trainer's adapters; full fine-tuning only (train.lora_rank 0)",
        ),
        (
            {"engine.batch_invariant": True, "train.batch_invariant": True, "cluster.trainers": 2},
            "train.batch_invariant: one trainer rank (cluster.trainers 1); FSDP2 ranks score by a path these "
            "numerics are not built for",
        ),
    ],
)
def test_batch_invariant_options_that_cannot_hold_are_refused_by_name(over, message, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        build_config(None, {"train.model": str(tiny_model_dir), "train.output_dir": str(tmp_path), **over})
    assert message in str(err.value)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_text"])
def test_models_whose_layers_the_numerics_do_not_cover_are_refused_by_name(family, tmp_path):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"engine batch_invariant: .*; {family}'s layers compute in kernels"):
        LLMEngine(str(tmp_path), dtype="float32", kv_cache_tokens=256, batch_invariant=True)
    with pytest.raises(ConfigError, match=f"train.batch_invariant: .*; {family}'s layers compute in kernels"):
        Actor(model, TrainConfig(dtype="float32", batch_invariant=True), AlgoConfig())


def test_the_engine_refuses_batch_invariance_where_it_cannot_hold():
    with pytest.raises(ValueError, match="engine batch_invariant: the trainer computes full-precision layers"):
        LLMEngine(make_model(), quantization="int8", batch_invariant=True)


# -- the GPU's strategy (`invariant.wide`: products and row reductions in float64), run here by
# routing the CPU through it: what a GPU computes under these numerics, checked where CI runs


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setattr(invariant, "wide", lambda device: True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_wide_product_is_the_float64_product_rounded_and_its_gradients_are_the_plain_formulas(dtype, wide):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 96, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(40, 96, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(40, generator=gen).to(dtype).requires_grad_()
    with invariant.numerics():
        y = F.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (2, 7, 40)
    assert torch.equal(y, (x.double() @ w.double().T + b.double()).to(dtype))
    g = torch.randn(2, 7, 40, generator=gen).to(dtype)
    y.backward(g)
    flat_g, flat_x = g.reshape(-1, 40), x.detach().reshape(-1, 96)
    assert torch.equal(x.grad, g @ w.detach())
    assert torch.equal(w.grad, flat_g.T @ flat_x)
    assert torch.equal(b.grad, flat_g.sum(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_row_reductions_are_float64_rounded_back_and_a_named_dtype_is_kept(dtype, wide):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 300, generator=gen) * 4).to(dtype)
    weight = torch.randn(300, generator=gen).to(dtype)
    with invariant.numerics():
        got = {
            "mean": x.mean(-1, keepdim=True),
            "torch.mean": torch.mean(x, dim=-1),
            "log_softmax": torch.log_softmax(x, dim=-1),
            "F.log_softmax": F.log_softmax(x, dim=-1),
            "softmax": x.softmax(-1),
            "logsumexp": torch.logsumexp(x, dim=-1),
            "rms_norm": F.rms_norm(x, (300,), weight, 1e-6),
        }
        named = torch.log_softmax(x, dim=-1, dtype=torch.float32)
    d = x.double()
    want = {
        "mean": d.mean(-1, keepdim=True),
        "torch.mean": d.mean(-1),
        "log_softmax": d.log_softmax(-1),
        "F.log_softmax": d.log_softmax(-1),
        "softmax": d.softmax(-1),
        "logsumexp": d.logsumexp(-1),
        "rms_norm": F.rms_norm(d, (300,), weight.double(), 1e-6),
    }
    for name, value in got.items():
        assert value.dtype == dtype and torch.equal(value, want[name].to(dtype)), name
    assert torch.equal(named, torch.log_softmax(x.float(), dim=-1))  # its own dtype: not widened
    # outside the numerics, and on a device that is not wide, the plain ops
    assert torch.equal(x.mean(-1), x.mean(-1)) and not invariant.active()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_under_the_gpus_strategy_the_trainer_scores_the_engines_bf16_tokens_bit_for_bit(family, wide, tmp_path):
    """bf16, where rounding to the model's dtype absorbs the float64 sums' last bits: the trainer's
    log-probs equal the engine's (here on the CPU's kernels; on a GPU, cuBLAS's and torch's own)."""
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    _scores_bit_for_bit(model, "bfloat16", _rollout(tmp_path, "bfloat16", batch_invariant=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_session.sh runs it)")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_a_gpu_the_trainer_scores_the_engines_bf16_tokens_bit_for_bit(family, tmp_path):
    """The float64 strategy on cuBLAS's and torch's own CUDA kernels: no graphs, no paged kernel."""
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    rollout = _rollout(tmp_path, "bfloat16", batch_invariant=True, device="cuda")
    _scores_bit_for_bit(model, "bfloat16", rollout, device="cuda")
