"""bf16 compute with fp32 master weights: the copy computes, the fp32 master accumulates and
updates, and the copy follows the master."""

import copy
import warnings

import pytest
import torch
from conftest import make_model, make_samples

from tidal.algo.options import AlgoConfig
from tidal.train.actor import Actor
from tidal.train.batching import collate_packed, packed_response_hidden
from tidal.train.options import TrainConfig
from tidal.train.precision import Bf16Compute

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def actor(dtype, lr=1e-3, **algo):
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, lr=lr, dtype=dtype, max_grad_norm=0.0)
    return Actor(make_model(seed=0), cfg, AlgoConfig(**algo))


def loss_of(model, samples):
    batch = collate_packed(samples)
    hidden = packed_response_hidden(model.base_model, batch)[batch["response_valid"]]
    logits = model.get_output_embeddings()(hidden).float()
    return torch.log_softmax(logits, -1).gather(-1, batch["response_ids"][batch["response_valid"]][:, None]).sum()


def test_the_copy_is_bf16_untied_with_fp32_buffers():
    master = make_model()
    mixed = Bf16Compute(master)
    c = mixed.model
    assert all(p.dtype == torch.bfloat16 for p in c.parameters())
    assert all(p.dtype == torch.float32 for p in master.parameters())
    assert c.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their dtype
    emb, head = c.get_input_embeddings(), c.get_output_embeddings()
    assert master.get_input_embeddings().weight is master.get_output_embeddings().weight
    assert emb.weight is not head.weight and emb.sparse
    want = master.get_input_embeddings().weight.to(torch.bfloat16)
    assert torch.equal(emb.weight, want) and torch.equal(head.weight, want)
    # both uses of the tied master weight are paired with it
    assert sum(m is master.get_input_embeddings().weight for m, _ in mixed.pairs) == 2


def test_micro_batch_gradients_accumulate_in_fp32_on_the_master():
    master = make_model()
    mixed = Bf16Compute(master)
    reference = copy.deepcopy(mixed.model)  # same bf16 weights, no hooks
    reference.get_input_embeddings().sparse = False
    samples = make_samples()
    for part in (samples[:4], samples[4:]):
        loss_of(mixed.model, part).backward()
        loss_of(reference, part).backward()
    assert all(p.grad is None for p in mixed.model.parameters())  # handed over and freed
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, m in master.named_parameters():
        want = ref[name].grad.float()
        if name == "model.embed_tokens.weight":  # tied: the projection's and the embedding's
            want = want + ref["lm_head.weight"].grad.float()
        assert m.grad.dtype == torch.float32
        # bf16 gradients summed in fp32 on the master vs in bf16 on the reference
        torch.testing.assert_close(m.grad, want, atol=2e-2 * float(want.abs().max()), rtol=0)
    assert master.get_input_embeddings().weight.grad.abs().sum() > 0


def test_updates_below_bf16_resolution_are_kept_and_the_copy_follows():
    a = actor("bfloat16", lr=1e-6)
    before = [p.detach().clone() for p in a.model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        a.train_step(make_samples(), ADV)
    moved = lost = total = 0
    for b, p in zip(before, a.model.parameters(), strict=True):
        moved += int((p != b).sum())
        lost += int((p.to(torch.bfloat16) == b.to(torch.bfloat16)).sum())
        total += p.numel()
    # AdamW's first step moves every weight with a gradient by ~lr: the fp32 master keeps it,
    # while the bf16 copies of nearly all of those weights cannot represent the change
    assert moved > 0.5 * total and lost > 0.9 * total
    for m, c in a.mixed.pairs:
        assert torch.equal(c, m.to(torch.bfloat16))


def test_bf16_gradient_tracks_the_fp32_gradient():
    grads = {}
    for dtype in ("float32", "bfloat16"):
        a = actor(dtype)
        a.optimizer.step = lambda *args, _a=a, _d=dtype, **kw: grads.__setitem__(
            _d, torch.cat([p.grad.flatten() for p in _a.params])
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            a.train_step(make_samples(), ADV)
    g32, g16 = grads["float32"], grads["bfloat16"]
    assert g32.norm() > 0
    assert (g16 - g32).norm() < 0.05 * g32.norm()


@pytest.mark.parametrize("dtype", ["bfloat16", "autocast"])
def test_kl_to_the_initial_model_is_exactly_zero_on_the_first_step(dtype):
    m = actor(dtype, kl_coef=0.5).train_step(make_samples(), torch.zeros(8))
    assert m["loss/kl"] == 0.0
