"""Routing replay in the trainer (`algo.routing_replay`): every policy forward routes each token
with the experts the engine recorded for it, in padded batches, packed rows and rows where a
group's prompt is stored once, in log-probs and in training steps."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import MOE_FAMILIES, loop_config, make_model, make_moe_model, make_samples

from tidal import moe
from tidal.algo.options import AlgoConfig
from tidal.options import ConfigError
from tidal.train.actor import Actor
from tidal.train.batching import collate, collate_packed
from tidal.train.options import TrainConfig
from tidal.types import Sample

LAYOUTS = {  # TrainConfig options of each micro-batch layout
    "padded": {"packing": False},
    "packed": {"packing": True, "share_prompts": False},
    "shared": {"packing": True, "share_prompts": True},
}
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -0.25, -2.0, 0.75])


def record(model, samples) -> list[Sample]:
    """Each sample's routing as an engine records it: one forward of the whole sample, positions
    0 .. len - 2 (the last token is never computed)."""
    with torch.no_grad(), moe.capture(model) as rec:
        for s in samples:
            model(torch.tensor([s.tokens]))
            s.set_routed_experts(moe.routing_record(rec.take()[:-1]))
    return samples


def actor(model, replay=True, layout="padded", **train):
    cfg = TrainConfig(
        **{"micro_batch_size": 8, "global_batch_size": 8, "lr": 1e-3, "dtype": "float32", **LAYOUTS[layout], **train}
    )
    return Actor(model, cfg, AlgoConfig(routing_replay=replay), temperature=0.8)


def step_grads(a, samples, adv=ADV):
    """The loss metrics of one train step and the gradients the optimizer saw."""
    grads = []
    step = a.optimizer.step

    def keep(*args, **kw):
        grads.extend(p.grad.detach().clone() for p in a.params)
        return step(*args, **kw)

    a.optimizer.step = keep
    with warnings.catch_warnings():  # the LR scheduler warns about a wrapped step()
        warnings.simplefilter("ignore", UserWarning)
        metrics = a.train_step(samples, adv)
    return metrics, grads


def perturbed_qwen3(samples, seed=0):
    """A Qwen3-MoE model and a copy whose first MoE router is moved just enough to choose another
    expert at one response-predicting token (the one closest to a tie): the copy's own routing
    differs from the original's recording there, deterministically. Returns (copy, (sample, position))."""
    model = make_moe_model("qwen3_moe", seed)
    router = moe.routers(model)[0]
    best = None
    seen: list[torch.Tensor] = []
    hook = router.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    for i, s in enumerate(samples):
        with torch.no_grad():
            model(torch.tensor([s.tokens]))
        hidden = seen.pop()
        logits = hidden @ router.weight.detach().T
        top = logits.topk(router.top_k + 1, dim=-1)
        for t in range(s.prompt_length - 1, len(s.tokens) - 1):
            margin = float(top.values[t, -2] - top.values[t, -1])
            if best is None or margin < best[0]:
                best = (margin, i, t, int(top.indices[t, -1]), hidden[t])
    hook.remove()
    margin, i, t, outside, h = best
    with torch.no_grad():  # raises expert `outside`'s logit at that token by margin + 0.05: it enters the top-k
        router.weight[outside] += (margin + 0.05) * h / (h @ h)
    return model, (i, t)


# ------------------------------------------------------------------ batches


def test_a_padded_batch_puts_each_record_on_its_flattened_tokens():
    samples = make_samples(4)
    for i, s in enumerate(samples):
        s.set_routed_experts(moe.routing_record(torch.full((len(s.tokens) - 1, 2, 2), i)))
    samples[1].set_routed_experts(moe.routing_record(torch.full((3, 2, 2), 1)))  # only 3 positions recorded
    batch = collate(samples, routing=True)
    b, width = batch["input_ids"].shape
    routed = batch["routed_experts"].view(b, width, 2, 2)
    mask = batch["routed_mask"].view(b, width)
    assert batch["routed_experts"].dtype == torch.int16 and routed.shape[0] * routed.shape[1] == b * width
    for i, s in enumerate(samples):
        n = 3 if i == 1 else len(s.tokens) - 1  # the last token and the padding have no record
        assert mask[i].tolist() == [p < n for p in range(width)]
        assert routed[i, :n].eq(i).all()


def test_a_row_with_shared_prompts_replays_the_stored_prompts_record():
    samples = make_samples(4, group=2)  # samples 0, 1 share a prompt, and 2, 3
    for i, s in enumerate(samples):
        s.set_routed_experts(moe.routing_record(torch.full((len(s.tokens) - 1, 2, 2), 10 + i)))
    batch = collate_packed(samples, share_prompts=True, routing=True)
    routed, mask = batch["routed_experts"][:, 0, 0].tolist(), batch["routed_mask"].tolist()
    want_ids, want_rec, want_mask = [], [], []
    for i, s in enumerate(samples):
        own = s.tokens if i % 2 == 0 else s.response_tokens  # a later group member stores its response only
        want_ids += own
        want_rec += [10 + i] * len(own)
        want_mask += [True] * (len(own) - 1) + [False]
    assert batch["input_ids"][0].tolist() == want_ids
    assert [r for r, m in zip(routed, mask, strict=True) if m] == [
        r for r, m in zip(want_rec, want_mask, strict=True) if m
    ]
    assert mask == want_mask


def test_a_sample_without_a_record_is_named():
    samples = record(make_moe_model(), make_samples(8))
    samples[5].routed_experts = None
    with pytest.raises(ValueError, match=r"sample 5 .*carries no routed_experts"):
        actor(make_moe_model()).compute_log_probs(samples)


# ------------------------------------------------------------------ log-probs and training


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_the_models_own_routing_changes_no_log_prob(family, layout):
    samples = record(make_moe_model(family), make_samples(8))
    free = actor(make_moe_model(family), replay=False, layout=layout).compute_log_probs(samples)
    replayed_actor = actor(make_moe_model(family), layout=layout)
    batch = replayed_actor.fwd.collate(samples)
    assert batch["routed_mask"].any()  # the replayed layout carries the records
    # the recorded experts are the ones this layout's forward chooses, so the computation is the same
    assert torch.equal(replayed_actor.compute_log_probs(samples), free)


def test_replay_routes_a_moved_model_with_the_recorded_experts():
    samples = record(make_moe_model("qwen3_moe"), make_samples(8))
    moved, (i, t) = perturbed_qwen3(samples)
    with torch.no_grad(), moe.capture(moved) as rec:
        moved(torch.tensor([samples[i].tokens]))
    assert not torch.equal(rec.take()[t, 0], moe.routing_tensor(samples[i].routed_experts)[t, 0].long())
    free = actor(moved, replay=False, layout="shared").compute_log_probs(samples)
    replayed = actor(moved, layout="shared").compute_log_probs(samples)
    j = t - samples[i].prompt_length + 1  # the response token that position t predicts
    assert (replayed[i, j] - free[i, j]).abs() > 1e-4
    # and replaying the moved model's own routing gives its free log-probs back
    own = record(moved, [Sample(**{**s.__dict__, "routed_experts": None}) for s in samples])
    torch.testing.assert_close(actor(moved, layout="shared").compute_log_probs(own), free, atol=0, rtol=0)


def test_a_batch_split_two_ways_trains_alike_under_replay():
    """One padded micro-batch vs packed rows of at most 40 tokens: the same loss and gradients,
    and not those of the moved model's free routing."""
    samples = record(make_moe_model("qwen3_moe"), make_samples(8))
    moved, _ = perturbed_qwen3(samples)
    state = {k: v.clone() for k, v in moved.state_dict().items()}

    def fresh():
        m = make_moe_model("qwen3_moe")
        m.load_state_dict(state)
        return m

    m1, g1 = step_grads(actor(fresh(), layout="padded"), samples)
    m2, g2 = step_grads(actor(fresh(), layout="shared", max_tokens_per_micro_batch=40), samples)
    m3, g3 = step_grads(actor(fresh(), replay=False, layout="padded"), samples)
    # the same tokens summed over other micro-batch cuts and attention layouts: fp32 rounding
    assert m1["loss/pg"] == pytest.approx(m2["loss/pg"], rel=1e-5, abs=1e-7)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert max((a - b).abs().max() for a, b in zip(g1, g3, strict=True)) > 1e-4


def test_activation_checkpointing_recomputes_the_forward_under_replay():
    """The backward's recomputed forward must route as the forward did: the same gradients with
    and without checkpointing on a model whose own routing differs from the recorded one."""
    samples = record(make_moe_model("qwen3_moe"), make_samples(8))
    moved, _ = perturbed_qwen3(samples)
    state = {k: v.clone() for k, v in moved.state_dict().items()}
    results = []
    for ckpt in (False, True, "selective"):
        m = make_moe_model("qwen3_moe")
        m.load_state_dict(state)
        results.append(step_grads(actor(m, layout="shared", gradient_checkpointing=ckpt), samples))
    (m1, g1), *others = results
    for m2, g2 in others:
        assert m1["loss/pg"] == m2["loss/pg"]
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_reference_log_probs_replay_and_the_teacher_does_not():
    samples = record(make_moe_model("qwen3_moe"), make_samples(8))
    moved, _ = perturbed_qwen3(samples)
    cfg = TrainConfig(micro_batch_size=8, global_batch_size=8, lr=1e-3, dtype="float32")
    a = Actor(moved, cfg, AlgoConfig(routing_replay=True, kl_coef=0.1), temperature=0.8)
    torch.testing.assert_close(a.compute_log_probs(samples, "reference"), a.compute_log_probs(samples), atol=0, rtol=0)
    free = actor(make_moe_model("qwen3_moe"), replay=False).compute_log_probs(samples)
    a.teacher = a.trained.frozen(make_moe_model("qwen3_moe"))  # another model: scored with its own routing
    torch.testing.assert_close(a.compute_log_probs(samples, "teacher"), free, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ configuration


def test_routing_replay_needs_an_moe_model(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="algo.routing_replay: needs an MoE model"):
        loop_config(tiny_model_dir, tmp_path / "run", **{"algo.routing_replay": True})
    with pytest.raises(ConfigError, match="algo.routing_replay: needs an MoE model"):
        actor(make_model(), replay=True)
    moe_dir = tmp_path / "moe"
    make_moe_model("qwen3_moe").save_pretrained(moe_dir)
    cfg = loop_config(moe_dir, tmp_path / "run", **{"algo.routing_replay": True})
    assert cfg.algo.routing_replay is True
    with pytest.raises(ConfigError) as e:
        loop_config(moe_dir, tmp_path / "run", **{"algo.routing_replay": True, "engine.kind": "vllm"})
    assert (
        "algo.routing_replay: engine.kind vllm does not return the experts it chose; engine.kind tidal or remote "
        "or sglang does (SGLang with --enable-return-routed-experts)"
    ) in str(e.value)
