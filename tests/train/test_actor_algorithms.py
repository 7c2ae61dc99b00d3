"""Actor.train_step across policy losses, loss aggregations and micro-batch layouts.

Gradients are recorded by wrapping `optimizer.step` (gradient clipping is off, so the recorded
gradient is the raw accumulated one). On the first update of a rollout the policy has not moved,
so the PPO ratio is 1 and every ratio-based loss has the per-token gradient -A * grad log p: that
gives exact reference values and exact relations between losses and aggregation modes.
"""

import math
import re
import warnings

import pytest
import torch
from conftest import make_model, make_samples

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.types import Sample

TEMPERATURE = 0.8
MAX_RESPONSE_LEN = 16
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

# the same 8 samples, one optimizer step (global_batch_size 8), cut and laid out six ways
LAYOUTS = {
    "padded_mbs8": {"micro_batch_size": 8, "packing": False},
    "padded_mbs1": {"micro_batch_size": 1, "packing": False},
    "packed_mbs3": {"micro_batch_size": 3, "packing": True},
    "packed_budget30": {"max_tokens_per_micro_batch": 30, "packing": True},
    "padded_budget30": {"max_tokens_per_micro_batch": 30, "packing": False},
    # the output projection and log-softmax 7 response tokens at a time (tidal.train.logits)
    "packed_chunked_logits": {"micro_batch_size": 8, "packing": True, "logits_chunk_tokens": 7},
}


def actor_with(layout="padded_mbs8", max_response_len=MAX_RESPONSE_LEN, **algo):
    cfg = TrainConfig(global_batch_size=8, lr=1e-3, dtype="float32", max_grad_norm=0.0, **LAYOUTS[layout])
    return Actor(
        make_model(seed=0), cfg, AlgoConfig(**algo), temperature=TEMPERATURE, max_response_len=max_response_len
    )


def train_recording(actor, samples, advantages, **kw):
    """(metrics, gradient) of one train_step that makes exactly one optimizer step."""
    grads = []
    step = actor.optimizer.step

    def record(*a, **k):
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in actor.params])
        return step(*a, **k)

    actor.optimizer.step = record
    with warnings.catch_warnings():  # the LR scheduler warns about a wrapped step()
        warnings.simplefilter("ignore", UserWarning)
        metrics = actor.train_step(samples, advantages, **kw)
    assert len(grads) == 1
    return metrics, grads[0]


def run(samples, advantages=ADV, layout="padded_mbs8", max_response_len=MAX_RESPONSE_LEN, train_kw=None, **algo):
    actor = actor_with(layout, max_response_len, **algo)
    return train_recording(actor, samples, advantages, **(train_kw or {}))


def assert_grads_close(a, b, atol=1e-7, rtol=1e-5):
    """Elementwise closeness; `atol` is for a gradient whose largest entry is 0.1 (a token-mean
    gradient here) and grows with it, since the float32 rounding of a sum scales with its terms:
    a per-sequence normaliser (seq_mean_token_sum: 8 instead of ~50 tokens) scales everything up."""
    assert len(a) == len(b)
    scale = max(float(x.abs().max()) for x in a)
    atol = atol * max(1.0, scale / 0.1)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def grad_norm(grads):
    return math.sqrt(sum(float(g.square().sum()) for g in grads))


def token_counts(samples):
    return torch.tensor([sum(s.loss_mask) for s in samples], dtype=torch.float32)


def hand_gradient(samples, weights):
    """Gradient of sum_i sum_t weights[i] * mask_it * log p(y_it), each sample scored alone with
    a plain full forward pass of a fresh copy of the initial model (no padding, no packing)."""
    model = make_model(seed=0).float().train()
    total = torch.zeros(())
    for s, w in zip(samples, weights, strict=True):
        logits = model(torch.tensor([s.tokens]), use_cache=False).logits[0].float() / TEMPERATURE
        lp = torch.log_softmax(logits, -1)[s.prompt_length - 1 : -1]
        lp = lp.gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0]
        total = total + float(w) * (lp * torch.tensor(s.loss_mask, dtype=torch.float32)).sum()
    total.backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def samples():
    return make_samples()


@pytest.fixture(scope="module")
def policy_log_probs(samples):
    """[N, R] log-probs of the initial policy (what the trainer computes on its first step)."""
    return actor_with().compute_log_probs(samples)


# ---------------------------------------------------------------------------------------------
# 1. the gradient and the logged metrics do not depend on how the batch is cut or laid out


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sft"])
def test_gradient_and_metrics_are_identical_for_every_layout(samples, policy_log_probs, loss, agg):
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(policy_log_probs.shape, generator=gen)
    if loss == "sft":
        algo, advantages, train_kw = {"mode": "sft", "loss_agg": agg}, None, {}
    else:
        algo = {"policy_loss": loss, "loss_agg": agg, "kl_coef": 0.1, "kl_kind": "k3", "entropy_coef": 0.01}
        advantages = ADV
        # an off-policy old policy (so ratios move and some clip) and a reference away from the
        # policy (so the KL term has a value and a gradient)
        train_kw = {
            "old_log_probs": policy_log_probs + 0.3 * noise,
            "ref_log_probs": policy_log_probs - 0.5 * noise.roll(1, dims=0),
        }
    results = {}
    for layout in LAYOUTS:
        actor = actor_with(layout, **algo)
        assert actor.fwd.packing == LAYOUTS[layout]["packing"]  # the packed layouts really pack
        n_micro = len(actor.fwd.plan(samples))
        assert n_micro == {"padded_mbs8": 1, "padded_mbs1": 8, "packed_mbs3": 3}.get(layout, n_micro)
        if "budget" in layout:
            assert n_micro > 1
        results[layout] = train_recording(actor, samples, advantages, **train_kw)

    base_m, base_g = results["padded_mbs8"]
    assert grad_norm(base_g) > 1e-4
    expected_keys = {"loss/sft"} if loss == "sft" else {"loss/pg", "loss/kl", "actor/rollout_logprob_abs_diff"}
    if loss != "sft":
        expected_keys.add("actor/clip_frac")
    assert expected_keys <= set(base_m)
    if loss == "ppo":
        assert base_m["actor/clip_frac"] > 0  # clipping is exercised, and must be counted identically
    if loss != "sft":
        assert base_m["loss/kl"] > 0
    for layout, (m, grads) in results.items():
        assert set(m) == set(base_m), layout
        assert_grads_close(base_g, grads)
        for k, v in base_m.items():
            assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (layout, k)


# ---------------------------------------------------------------------------------------------
# 2. reference values on the first (on-policy, ratio = 1) step


@pytest.mark.parametrize("agg", AGGS)
def test_first_step_gradient_matches_a_hand_built_objective(samples, agg):
    """PPO at ratio 1: per-token loss -A_i, so the gradient of mode M is that of
    -sum_i A_i c_i sum_{t in mask_i} log p_it with c_i the mode's normaliser."""
    n = token_counts(samples)
    big_n, rows, b = float(n.sum()), float((n > 0).sum()), len(samples)
    scale = {
        "token_mean": torch.full_like(n, 1 / big_n),
        "seq_mean_token_mean": 1 / (n * rows),
        "seq_mean_token_sum": torch.full_like(n, 1 / rows),
        "seq_mean_token_sum_norm": torch.full_like(n, 1 / (b * MAX_RESPONSE_LEN)),
    }[agg]
    m, got = run(samples, policy_loss="ppo", loss_agg=agg)
    want = hand_gradient(samples, -ADV * scale)
    assert grad_norm(want) > 1e-4
    assert_grads_close(want, got, atol=1e-6, rtol=1e-4)
    # the logged loss/pg is the token mean of the per-token loss, whatever the aggregation
    assert m["loss/pg"] == pytest.approx(float(-(ADV * n).sum() / n.sum()), abs=1e-6)
    assert m["actor/clip_frac"] == 0.0
    assert m["actor/approx_kl"] == 0.0
    assert m["actor/tokens"] == big_n - float(n[ADV == 0].sum())  # zero-advantage samples are not computed


def test_first_step_gradients_of_the_aggregation_modes_are_exact_rescalings(samples):
    n = token_counts(samples)
    big_n, rows, b = float(n.sum()), float((n > 0).sum()), len(samples)
    _, tm = run(samples, loss_agg="token_mean")
    _, sts = run(samples, loss_agg="seq_mean_token_sum")
    _, norm16 = run(samples, loss_agg="seq_mean_token_sum_norm", max_response_len=16)
    _, norm32 = run(samples, loss_agg="seq_mean_token_sum_norm", max_response_len=32)
    _, smtm = run(samples, loss_agg="seq_mean_token_mean")
    # token_mean with per-sample advantages A_i * N / (rows * n_i) is seq_mean_token_mean with A_i
    _, tm_rescaled = run(samples, advantages=ADV * big_n / (rows * n), loss_agg="token_mean")
    assert grad_norm(tm) > 1e-4
    assert_grads_close([g * big_n / rows for g in tm], sts)
    assert_grads_close([g * big_n / (b * 16) for g in tm], norm16)
    assert_grads_close(tm_rescaled, smtm)
    # doubling Dr.GRPO's constant normaliser halves the gradient, bit for bit (a power of 2)
    for a, c in zip(norm16, norm32, strict=True):
        assert torch.equal(a, 2 * c)


def test_sft_first_step_loss_and_gradient(samples, policy_log_probs):
    mask = torch.zeros_like(policy_log_probs)
    for i, s in enumerate(samples):
        mask[i, : s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float32)
    m, got = run(samples, advantages=None, mode="sft")
    assert m["loss/sft"] == pytest.approx(float(-(policy_log_probs * mask).sum() / mask.sum()), abs=1e-5)
    assert "loss/pg" not in m and "actor/clip_frac" not in m
    want = hand_gradient(samples, torch.full((len(samples),), -1 / float(mask.sum())))
    assert_grads_close(want, got, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# 3. equalities between losses at ratio 1


@pytest.mark.parametrize("agg", AGGS)
def test_cispo_equals_ppo_on_the_first_step(samples, policy_log_probs, agg):
    m_ppo, g_ppo = run(samples, policy_loss="ppo", loss_agg=agg)
    m_cispo, g_cispo = run(samples, policy_loss="cispo", loss_agg=agg)
    assert grad_norm(g_ppo) > 1e-4
    assert_grads_close(g_ppo, g_cispo)
    assert m_cispo["actor/clip_frac"] == 0.0
    # CISPO's per-token loss is -w * A * log p with w = 1: its logged token mean is known by hand
    mask = torch.zeros_like(policy_log_probs)
    for i, s in enumerate(samples):
        mask[i, : s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float32)
    want = -(ADV[:, None] * policy_log_probs * mask).sum() / mask.sum()
    assert m_cispo["loss/pg"] == pytest.approx(float(want), abs=1e-5)


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_gspo_equals_ppo_on_the_first_step(samples, agg):
    m_ppo, g_ppo = run(samples, policy_loss="ppo", loss_agg=agg)
    m_gspo, g_gspo = run(samples, policy_loss="gspo", loss_agg=agg)
    assert grad_norm(g_ppo) > 1e-4
    assert_grads_close(g_ppo, g_gspo)
    assert m_gspo["loss/pg"] == pytest.approx(m_ppo["loss/pg"], abs=1e-7)
    assert m_gspo["actor/clip_frac"] == 0.0
    assert m_gspo["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-7)


def test_gspo_auto_aggregation_is_seq_mean_token_mean(samples):
    _, g_auto = run(samples, advantage="gspo")  # policy_loss and loss_agg auto
    _, g_ppo = run(samples, policy_loss="ppo", loss_agg="seq_mean_token_mean")
    assert_grads_close(g_auto, g_ppo)


# ---------------------------------------------------------------------------------------------
# 4. train/rollout importance-sampling correction


def with_rollout_log_probs(samples, log_probs):
    return [
        Sample(**{**s.__dict__, "rollout_log_probs": log_probs[i, : s.response_length].tolist()})
        for i, s in enumerate(samples)
    ]


def test_is_correction_is_a_no_op_when_rollout_matches_the_trainer(samples, policy_log_probs):
    matched = with_rollout_log_probs(samples, policy_log_probs)
    _, g_none = run(matched)
    for mode in ("truncate", "mask"):
        m, g = run(matched, is_correction=mode, is_high=2.0)
        assert_grads_close(g_none, g)
        assert m["is/mismatch_abs_diff"] == pytest.approx(0.0, abs=1e-5)
        assert m["is/weight_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_is_correction_truncates_and_masks_a_ratio_of_four(samples, policy_log_probs, level):
    shifted = with_rollout_log_probs(samples, policy_log_probs - math.log(4.0))
    _, g_none = run(shifted)
    assert grad_norm(g_none) > 1e-4

    m, g = run(shifted, is_correction="truncate", is_high=2.0, is_level=level)
    assert_grads_close([2 * x for x in g_none], g, atol=1e-7, rtol=1e-6)
    assert m["is/clipped_frac"] == pytest.approx(1.0)
    assert m["is/weight_mean"] == pytest.approx(2.0, abs=1e-6)
    assert m["is/mismatch_abs_diff"] == pytest.approx(math.log(4.0), abs=1e-5)
    assert m["actor/rollout_logprob_abs_diff"] == pytest.approx(math.log(4.0), abs=1e-5)

    m, g = run(shifted, is_correction="mask", is_high=2.0, is_level=level)
    assert all(not x.any() for x in g)
    assert m["actor/grad_norm"] == 0.0
    assert m["is/masked_frac"] == 1.0
    assert m["is/weight_mean"] == 0.0
    assert m["is/mismatch_abs_diff"] == pytest.approx(math.log(4.0), abs=1e-5)


# ---------------------------------------------------------------------------------------------
# 5. a user policy loss given by path


USER_LOSS = """
import torch


def ppo_like(log_probs, old_log_probs, advantages, mask, algo):
    ratio = torch.exp(log_probs - old_log_probs)
    return -advantages * ratio * mask, {"ratio_seen": (ratio * mask).sum() / mask.sum(), "eps": algo.eps_clip}


def wrong_shape(log_probs, old_log_probs, advantages, mask, algo):
    return (-advantages * log_probs)[:, :-1], {}
"""


def test_user_policy_loss_by_path(samples, tmp_path):
    file = tmp_path / "my_loss.py"
    file.write_text(USER_LOSS)
    m_user, g_user = run(samples, policy_loss=f"{file}:ppo_like", eps_clip=0.3)
    m_ppo, g_ppo = run(samples, policy_loss="ppo")
    assert grad_norm(g_ppo) > 1e-4
    assert_grads_close(g_ppo, g_user)
    assert m_user["loss/pg"] == pytest.approx(m_ppo["loss/pg"], abs=1e-7)
    # its metrics are logged under actor/ (token-weighted means), and it receives the AlgoConfig
    assert m_user["actor/ratio_seen"] == pytest.approx(1.0, abs=1e-7)
    assert m_user["actor/eps"] == pytest.approx(0.3)


def test_user_policy_loss_of_the_wrong_shape_is_rejected(samples, tmp_path):
    file = tmp_path / "my_loss.py"
    file.write_text(USER_LOSS)
    name = f"{file}:wrong_shape"
    r = max(s.response_length for s in samples)
    msg = f"policy loss {name} returned shape (8, {r - 1}), expected (8, {r})"
    with pytest.raises(ValueError, match=re.escape(msg)):
        run(samples, policy_loss=name)


# ---------------------------------------------------------------------------------------------
# 6. KL folded into the reward is no loss term


def test_kl_in_reward_adds_no_kl_loss_term(samples):
    actor = actor_with(kl_coef=0.1, kl_kind="k1", kl_in_reward=True)
    assert actor.ref is not None  # the loop still needs reference log-probs for the shaping
    m, g = train_recording(actor, samples, ADV)
    assert "loss/kl" not in m
    _, g_plain = run(samples)
    assert_grads_close(g_plain, g)
    # with the KL as a loss term instead (k1 has a gradient even against an identical reference)
    m_loss, g_loss = run(samples, kl_coef=0.1, kl_kind="k1")
    assert "loss/kl" in m_loss
    assert max(float((a - b).abs().max()) for a, b in zip(g_plain, g_loss, strict=True)) > 1e-5
