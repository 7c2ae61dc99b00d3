import contextlib
import copy
import warnings

import pytest
import torch
from conftest import make_model, make_samples

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.types import Sample


def actor_with(micro, gbs=8, dtype="float32", **algo):
    cfg = TrainConfig(micro_batch_size=micro, global_batch_size=gbs, lr=1e-3, dtype=dtype, max_grad_norm=1.0)
    return Actor(make_model(seed=0), cfg, AlgoConfig(**algo), temperature=0.8)


def test_log_probs_match_a_plain_forward_pass():
    actor = actor_with(3)
    samples = make_samples()
    got = actor.compute_log_probs(samples)
    model = actor.model.eval()
    for s, lp in zip(samples, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0].float() / 0.8
        ref = torch.log_softmax(logits, -1)[s.prompt_length - 1 : -1].gather(
            1, torch.tensor(s.response_tokens)[:, None]
        )[:, 0]
        assert got.shape == (len(samples), max(x.response_length for x in samples))
        torch.testing.assert_close(lp[: s.response_length], ref, atol=1e-5, rtol=0)
        assert not lp[s.response_length :].any()  # padding is exactly 0


@pytest.mark.parametrize("algo", [{}, {"kl_coef": 0.1, "kl_kind": "k3"}, {"entropy_coef": 0.01}])
def test_gradient_is_identical_for_any_micro_batch_size(algo):
    samples = make_samples()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
    results = []
    for micro in (1, 3, 8):
        actor = actor_with(micro, **algo)
        grads = []
        step = actor.optimizer.step

        def record(*a, _step=step, _actor=actor, _grads=grads, **kw):
            _grads.extend(p.grad.detach().clone() for p in _actor.params)
            return _step(*a, **kw)

        actor.optimizer.step = record
        with warnings.catch_warnings():  # the LR scheduler warns about a wrapped step()
            warnings.simplefilter("ignore", UserWarning)
            metrics = actor.train_step(samples, adv)
        results.append((metrics, grads))
    base_m, base_g = results[0]
    assert any(g.abs().max() > 1e-4 for g in base_g)
    for m, grads in results[1:]:
        for a, b in zip(base_g, grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
        for k in ("loss/pg", "actor/grad_norm", "actor/entropy", "actor/clip_frac"):
            assert m[k] == pytest.approx(base_m[k], rel=1e-5, abs=1e-7), k
    # the sample with advantage 0 is skipped unless a KL or entropy term gives it a loss
    skipped = 0 if algo else 1
    assert base_m["actor/skipped_samples"] == skipped
    assert base_m["actor/tokens"] == sum(sum(s.loss_mask) for s in samples) - skipped * sum(samples[5].loss_mask)


def grads_and_metrics(actor, samples, adv, steps=1):
    """Gradients seen by the optimizer at each step, the metrics, and the parameters after."""
    grads = []
    step = actor.optimizer.step

    def record(*a, **kw):
        grads.append([p.grad.detach().clone() for p in actor.params])
        return step(*a, **kw)

    actor.optimizer.step = record
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        metrics = [actor.train_step(samples, adv) for _ in range(steps)]
    return grads, metrics, [p.detach().clone() for p in actor.params]


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
def test_skipping_zero_advantage_samples_keeps_gradient_metrics_and_update(loss):
    samples = make_samples()
    adv = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, -1.0, 0.0, 0.25])
    runs = {}
    for skip in (True, False):
        cfg = TrainConfig(micro_batch_size=3, global_batch_size=8, lr=1e-3, dtype="float32", skip_zero_advantage=skip)
        actor = Actor(make_model(seed=0), cfg, AlgoConfig(policy_loss=loss), temperature=0.8)
        runs[skip] = grads_and_metrics(actor, samples, adv, steps=2)
    (g_skip, m_skip, p_skip), (g_all, m_all, p_all) = runs[True], runs[False]
    assert m_skip[0]["actor/skipped_samples"] == 4 and m_all[0]["actor/skipped_samples"] == 0
    for a, b in zip(g_skip[0] + g_skip[1], g_all[0] + g_all[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    for a, b in zip(p_skip, p_all, strict=True):  # AdamW divides by sqrt(v): float noise on tiny gradients
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)
    for k in ("loss/pg", "actor/grad_norm"):
        assert m_skip[1][k] == pytest.approx(m_all[1][k], rel=1e-5, abs=1e-8), k


def test_a_batch_with_no_signal_still_takes_the_adamw_step():
    """All advantages 0: nothing is computed, yet AdamW's step (momentum from the step before,
    weight decay) moves the weights exactly as with the zero gradient computed."""
    samples = make_samples()
    # No zero in the first step's advantages: both runs then compute the same micro-batches in the
    # same order, so their weights after it are bit-identical and the second step can be compared
    # exactly. (With a skipped sample the gradient sums run in a different order and round
    # differently on some CPUs, e.g. by 6e-8 on AVX2.)
    first = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.75, -2.0, 0.25])
    after, start = {}, {}
    for skip in (True, False):
        cfg = TrainConfig(
            micro_batch_size=4,
            global_batch_size=8,
            lr=1e-3,
            dtype="float32",
            weight_decay=0.1,
            skip_zero_advantage=skip,
        )
        actor = Actor(make_model(seed=0), cfg, AlgoConfig(), temperature=0.8)
        assert actor.train_step(samples, first)["actor/skipped_samples"] == 0
        before = [p.detach().clone() for p in actor.params]
        start[skip] = before
        m = actor.train_step(samples, torch.zeros(8))
        assert m["actor/skipped_samples"] == (8 if skip else 0)
        assert m["loss/pg"] == 0.0 and m["actor/grad_norm"] == 0.0
        assert any(not torch.equal(a, b) for a, b in zip(before, actor.params, strict=True))
        after[skip] = [p.detach().clone() for p in actor.params]
    for a, b in zip(start[True], start[False], strict=True):
        assert torch.equal(a, b)
    # the zero gradient (skipped or computed as exact zeros) goes through the same AdamW ops: exact
    for a, b in zip(after[True], after[False], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_on_policy_first_step_loss_is_minus_token_mean_advantage():
    samples = make_samples()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
    m = actor_with(4).train_step(samples, adv)
    tokens = torch.tensor([sum(s.loss_mask) for s in samples], dtype=torch.float32)
    # ratio == 1 on the first update, so the PPO loss is -A per token, averaged over all tokens
    assert m["loss/pg"] == pytest.approx(float(-(adv * tokens).sum() / tokens.sum()), abs=1e-6)
    assert m["actor/clip_frac"] == 0.0
    assert m["actor/approx_kl"] == 0.0


def test_several_updates_per_rollout_use_frozen_old_log_probs():
    samples = make_samples()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
    actor = actor_with(2, gbs=4)
    before = copy.deepcopy(actor.model)
    m = actor.train_step(samples, adv)
    assert m["actor/updates"] == 2.0
    # the second update sees a moved policy against frozen old log-probs, so the ratio moved
    assert m["actor/approx_kl"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), actor.model.parameters(), strict=True))


def test_kl_is_zero_against_an_identical_reference():
    samples = make_samples()
    m = actor_with(4, kl_coef=0.5).train_step(samples, torch.zeros(8))
    assert m["loss/kl"] == pytest.approx(0.0, abs=1e-7)


def test_masked_tokens_do_not_move_the_model():
    samples = make_samples()
    adv = torch.ones(8)
    zeroed = [Sample(**{**s.__dict__, "loss_mask": [0] * s.response_length}) for s in samples]
    actor = actor_with(4)
    before = [p.detach().clone() for p in actor.model.parameters()]
    m = actor.train_step(zeroed, adv)
    assert m["actor/grad_norm"] == 0.0
    for a, b in zip(before, actor.model.parameters(), strict=True):
        assert torch.equal(a, b.detach())


def test_batch_size_must_divide():
    with pytest.raises(ValueError, match="7 samples is not a multiple of global_batch_size 8"):
        actor_with(4).train_step(make_samples(7), torch.zeros(7))


class CastCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts fp32 → bf16 casts of tensors shaped like the embedding (the tied output projection)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.casts = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is torch.bfloat16:
            self.casts += tuple(args[0].shape) == self.shape
        return func(*args, **kwargs)


def train_grads(actor, samples, adv):
    grads = []
    step = actor.optimizer.step

    def record(*a, **kw):
        grads.extend(p.grad.detach().clone() for p in actor.params)
        return step(*a, **kw)

    actor.optimizer.step = record
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        actor.train_step(samples, adv)
    return grads


def test_bf16_weights_are_cast_once_per_optimizer_step_with_the_same_gradient():
    """Under bf16 autocast each fp32 weight is cast once per optimizer step, not once per
    micro-batch, and the gradient is bitwise the one of casting per micro-batch."""
    samples = make_samples()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
    cached = actor_with(2, dtype="autocast")
    counter = CastCounter(cached.model.get_input_embeddings().weight.shape)
    with counter:
        got = train_grads(cached, samples, adv)
    assert len(cached.fwd.plan(samples)) == 4 and counter.casts == 1

    per_micro_batch = actor_with(2, dtype="autocast")
    per_micro_batch.trained.one_cast_per_update = contextlib.nullcontext  # each _score region casts again
    counter = CastCounter(per_micro_batch.model.get_input_embeddings().weight.shape)
    with counter:
        want = train_grads(per_micro_batch, samples, adv)
    assert counter.casts == 4
    assert any(g.abs().max() > 0 for g in want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
