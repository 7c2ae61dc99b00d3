"""A NaN/Inf loss or gradient skips the optimizer step (weights, AdamW state and schedule untouched),
and `train.max_bad_steps` bad steps in a row stop the run."""

import math

import pytest
import torch
from conftest import make_model, make_samples

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig
from tidal.train.update import BadStepsError

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def _actor(max_bad_steps=3):
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, lr=1e-3, dtype="float32", max_bad_steps=max_bad_steps)
    return Actor(make_model(seed=0), cfg, AlgoConfig(), temperature=0.8)


def _snapshot(actor):
    weights = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    state = {
        i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(actor.optimizer.state[p] for p in actor.params)
    }
    return weights, state, actor.scheduler.last_epoch


def _same(a, b):
    (w1, s1, e1), (w2, s2, e2) = a, b
    assert e1 == e2
    for n in w1:
        assert torch.equal(w1[n], w2[n]), n
    for i in s1:
        for k in s1[i]:
            assert torch.equal(s1[i][k], s2[i][k]), (i, k)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_skips_the_step(bad, caplog):
    actor = _actor()
    samples = make_samples()
    actor.train_step(samples, ADV)  # AdamW now has moments and a step count
    before = _snapshot(actor)
    adv = ADV.clone()
    adv[2] = bad
    with caplog.at_level("WARNING", logger="tidal"):
        m = actor.train_step(samples, adv)
    _same(before, _snapshot(actor))
    assert math.isnan(m["actor/grad_norm"]) and m["actor/bad_steps"] == 1.0
    assert all(p.grad is None for p in actor.params)  # the bad gradient is not carried into the next step
    assert "optimizer step skipped: non-finite" in caplog.text
    assert "1 bad step(s) in a row, the run stops at 3 (train.max_bad_steps)" in caplog.text
    # a good step afterwards moves the weights again, as if the bad one had not happened
    m = actor.train_step(samples, ADV)
    assert m["actor/bad_steps"] == 0.0 and m["actor/grad_norm"] > 0
    w_after = _snapshot(actor)[0]
    assert any(not torch.equal(before[0][n], w_after[n]) for n in w_after)


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_step():
    actor = _actor()
    samples = make_samples()
    before = _snapshot(actor)
    # poison one gradient in the backward pass only: the loss stays finite
    first = actor.params[0]
    handle = first.register_hook(lambda g: torch.full_like(g, math.inf))
    m = actor.train_step(samples, ADV)
    handle.remove()
    assert m["actor/bad_steps"] == 1.0
    _same(before, _snapshot(actor))


def test_max_bad_steps_in_a_row_stop_the_run():
    actor = _actor(max_bad_steps=2)
    samples = make_samples()
    nan_adv = torch.full_like(ADV, math.nan)
    actor.train_step(samples, nan_adv)
    actor.train_step(samples, ADV)  # a good step resets the count
    actor.train_step(samples, nan_adv)
    with pytest.raises(BadStepsError) as err:
        actor.train_step(samples, nan_adv)
    assert str(err.value) == (
        "train: 2 optimizer steps in a row had a non-finite loss or gradient (train.max_bad_steps 2); "
        "the last: non-finite loss. Lower train.lr, check the rewards and advantages, or use float32."
    )
