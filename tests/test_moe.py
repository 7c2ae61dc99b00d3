"""tidal.moe on tiny random MoE models of four families: finding the routers, recording their
choice, the routing-weight formulas, and replaying a recorded or a different routing; and the
`Sample` field that carries a recording (`RoutedExperts`)."""

from __future__ import annotations

import importlib
import inspect
import json
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import MOE_FAMILIES, make_model, make_moe_model

from tidal import moe
from tidal.types import RoutedExperts, Sample

MOE_LAYERS = {"qwen3_moe": [1, 2], "mixtral": [0, 1, 2], "glm4_moe": [1, 2], "deepseek_v3": [1, 2]}


def ids(batch=2, length=9, seed=0):
    return torch.randint(0, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


def router_inputs(model):
    """Hooks keeping each router's input [T, H]; returns (list, handles)."""
    seen = []
    hs = [r.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach())) for r in moe.routers(model)]
    return seen, hs


def shifted(indices, experts):
    """Another valid routing: every expert id moved by one (still k distinct ids per token)."""
    return ((indices.long() + 1) % experts).to(indices.dtype)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routers_are_found_in_layer_order_and_dense_layers_have_none(family):
    model = make_moe_model(family)
    found = moe.routers(model)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(r)] for r in found] == [f"model.layers.{i}.mlp.gate" for i in MOE_LAYERS[family]]
    assert moe.routing_shape(model) == (len(MOE_LAYERS[family]), 2)
    dense = make_model()
    assert moe.routers(dense) == [] and moe.routing_shape(dense) is None


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_capture_gives_each_routers_own_choice_per_flattened_token(family):
    model = make_moe_model(family)
    seen, hs = router_inputs(model)
    x = ids()
    with torch.no_grad(), moe.capture(model) as rec:
        model(x)
        got = rec.take()
        assert rec.take() is None  # take() clears
        model(x[:1, :4])
        model(x[1:, :3])
        two = rec.take()
    for h in hs:
        h.remove()
    n_layers = len(MOE_LAYERS[family])
    assert got.dtype == torch.int16 and got.shape == (18, n_layers, 2)
    for layer, r in enumerate(moe.routers(model)):
        with torch.no_grad():
            own = r(seen[layer])[2]  # the router rerun on the tokens it saw: [B * S, k], row b * S + s
        assert torch.equal(got[:, layer].long(), own)
    assert two.shape == (7, n_layers, 2)  # two forwards, concatenated in call order
    assert torch.equal(two[:4], got[:4]) and torch.equal(two[4:], got[9:12])  # causal: a prefix routes alike


def test_capture_of_a_dense_model_gives_nothing():
    model = make_model()
    with moe.capture(model) as rec:
        model(ids())
    assert rec.take() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_route_weights_of_the_routers_own_choice_equal_its_weights_exactly(family, dtype):
    model = make_moe_model(family).to(dtype)
    for r in moe.routers(model):
        h = torch.randn(40, r.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
        with torch.no_grad():
            logits, weights, idx = r(h)
            got = moe.route_weights(r, logits, idx)
        assert got.dtype == weights.dtype
        assert torch.equal(got, weights)


def test_route_weights_follow_each_family_formula():
    """The named formulas against a hand computation on numbers, one per kind."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    idx = torch.tensor([[3, 0]])
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(moe.softmax_topk_weights(logits, idx, False, torch.float32), p[[3, 0]][None])
    want = p[[3, 0]] / (p[3] + p[0])
    torch.testing.assert_close(moe.softmax_topk_weights(logits, idx, True, torch.float32), want[None])
    s = torch.sigmoid(logits)[0]
    torch.testing.assert_close(moe.sigmoid_group_weights(logits, idx, False, 2.5), 2.5 * s[[3, 0]][None])
    want = 2.5 * s[[3, 0]] / (s[3] + s[0])
    torch.testing.assert_close(moe.sigmoid_group_weights(logits, idx, True, 2.5), want[None])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_the_captured_routing_reproduces_the_logits_exactly(family):
    model = make_moe_model(family)
    x = ids()
    with torch.no_grad():
        with moe.capture(model) as rec:
            free = model(x).logits
        with moe.replay(model, rec.take()):
            again = model(x).logits
    assert torch.equal(again, free)


def hand_moe_block(block, x, indices, family):
    """The MoE block's output [T, H] for experts `indices` [T, k], with the routing weights from
    the family's formula written out: softmax top-k (renormalised: qwen3 norm_topk_prob, mixtral)
    or sigmoid top-k renormalised times the scaling factor, plus the shared experts."""
    r, ex = block.gate, block.experts
    logits = x @ r.weight.T
    if family in ("qwen3_moe", "mixtral"):
        w = torch.softmax(logits, -1).gather(1, indices)
        w = w / w.sum(-1, keepdim=True)
    else:
        w = torch.sigmoid(logits).gather(1, indices)
        w = w / w.sum(-1, keepdim=True) * r.routed_scaling_factor
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            gate, up = (ex.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (ex.down_proj[e] @ (F.silu(gate) * up))
    if hasattr(block, "shared_experts"):
        out = out + block.shared_experts(x)
    return out


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_another_routing_changes_the_logits_as_the_formula_says(family):
    model = make_moe_model(family)
    x = ids()
    block = model.model.layers[MOE_LAYERS[family][-1]].mlp
    io = []
    hook = block.register_forward_hook(lambda m, a, out: io.append((a[0].detach().reshape(-1, 32), out.detach())))
    with torch.no_grad():
        with moe.capture(model) as rec:
            free = model(x).logits
        other = shifted(rec.take(), moe.routers(model)[0].weight.shape[0])
        with moe.replay(model, other):
            replayed = model(x).logits
    hook.remove()
    assert (replayed - free).abs().max() > 0.1
    block_in, block_out = io[1]  # the replayed forward's last MoE layer
    with torch.no_grad():
        want = hand_moe_block(block, block_in, other[:, -1].long(), family)
    # same products, summed in another order (one expert at a time vs the grouped kernel): fp32 rounding
    torch.testing.assert_close(block_out.reshape(-1, 32), want, atol=1e-6, rtol=1e-5)


def test_positions_masked_out_keep_the_routers_own_choice():
    model = make_moe_model("qwen3_moe")
    x = ids()
    with torch.no_grad():
        with moe.capture(model) as rec:
            free = model(x).logits
        own = rec.take()
        other = shifted(own, 8)
        with moe.replay(model, other, torch.zeros(18, dtype=torch.bool)):
            assert torch.equal(model(x).logits, free)
        mask = torch.arange(18) % 2 == 0
        with moe.replay(model, other, mask), moe.capture(model) as rec:  # capture sees the replayed choice
            model(x)
        used = rec.take()
    # layer 0's input does not depend on the routing, so its unmasked rows are the router's own choice
    assert torch.equal(used[:, 0], torch.where(mask[:, None], other[:, 0], own[:, 0]))
    assert torch.equal(used[mask], other[mask])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gradients_reach_the_router_under_replay_as_without_it(family):
    model = make_moe_model(family).train()
    x = ids()
    with moe.capture(model) as rec:
        model(x).logits.pow(2).mean().backward()
    free = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with moe.replay(model, rec.take()):
        model(x).logits.pow(2).mean().backward()
    for r in moe.routers(model):
        assert r.weight.grad.abs().max() > 1e-6
    for n, p in model.named_parameters():  # the same routing: top-k values vs a gather of the same softmax
        torch.testing.assert_close(p.grad, free[n], atol=1e-7, rtol=1e-5, msg=n)


def test_replay_checks_the_indices_against_the_model_and_its_tokens():
    model = make_moe_model("qwen3_moe")
    x = ids()
    with torch.no_grad(), moe.capture(model) as rec:
        model(x)
    own = rec.take()
    with pytest.raises(ValueError, match="flattened tokens"), torch.no_grad(), moe.replay(model, own[:10]):
        model(x)
    with pytest.raises(ValueError, match=r"\[tokens, 2 MoE layers, top_k 2\]"), moe.replay(model, own[:, :1]):
        pass
    bad = own.clone()
    bad[3, 1, 0] = 8
    with pytest.raises(ValueError, match=r"expert ids must be in 0\.\.7"), moe.replay(model, bad):
        pass
    with moe.replay(model, bad, torch.arange(18) != 3):  # an unrecorded position may hold anything
        pass
    with pytest.raises(ValueError, match="no MoE router"), moe.replay(make_model(), own):
        pass


def test_an_unknown_router_class_is_named():
    class FancyTopKRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k = 2
            self.weight = torch.nn.Parameter(torch.randn(4, 8))

    model = torch.nn.Sequential(FancyTopKRouter())
    assert moe.routing_shape(model) == (1, 2)
    with pytest.raises(ValueError, match="FancyTopKRouter"):
        moe.route_weights(model[0], torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="FancyTopKRouter"), moe.replay(model, torch.zeros(3, 1, 2)):
        pass
    with pytest.raises(ValueError, match="FancyTopKRouter"), moe.capture(model):
        pass


# the routers whose formula is the one of each tested family: their forward must be the same code
REFERENCES = {
    "Qwen3MoeTopKRouter": "qwen3_moe",
    "Qwen2MoeTopKRouter": "qwen2_moe",
    "Qwen3NextTopKRouter": "qwen3_next",
    "OlmoeTopKRouter": "olmoe",
    "FlexOlmoTopKRouter": "flex_olmo",
    "Qwen3OmniMoeThinkerTextTopKRouter": "qwen3_omni_moe",
    "Qwen3VLMoeTextTopKRouter": "qwen3_vl_moe",
    "Qwen3_5MoeTopKRouter": "qwen3_5_moe",
    "MixtralTopKRouter": "mixtral",
    "MiniMaxTopKRouter": "minimax",
    "DeepseekV3TopkRouter": "deepseek_v3",
    "Glm4MoeTopkRouter": "glm4_moe",
    "Glm4vMoeTextTopkRouter": "glm4v_moe",
    "Glm4MoeLiteTopkRouter": "glm4_moe_lite",
    "Dots1TopkRouter": "dots1",
    "ExaoneMoeTopkRouter": "exaone_moe",
    "SolarOpenTopkRouter": "solar_open",
    "GraniteMoeHybridTopKRouter": "granitemoehybrid",
    "Lfm2MoeTopKRouter": "lfm2_moe",
}


def test_every_listed_router_class_runs_the_forward_of_its_formula():
    """A class is listed under a formula only if its forward is character for character the forward
    of a class of that formula; a transformers upgrade that changes one fails here."""
    assert set(REFERENCES) == set(moe.ROUTE_WEIGHTS)
    sources = {}
    for cls_name, module in REFERENCES.items():
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        sources[cls_name] = inspect.getsource(getattr(mod, cls_name).forward)
    by_formula: dict = {}
    for cls_name, fn in moe.ROUTE_WEIGHTS.items():
        by_formula.setdefault(fn, set()).add(sources[cls_name])
    assert len(by_formula) == 6 and all(len(s) == 1 for s in by_formula.values())
    # and the six formulas are six different forwards
    assert len({next(iter(s)) for s in by_formula.values()}) == 6


# ------------------------------------------------------------------ the record a sample carries


def test_a_record_round_trips_through_bytes_dicts_json_and_pickle():
    t = torch.randint(-1, 300, (5, 3, 2), dtype=torch.int32)
    rec = moe.routing_record(t)
    assert rec.shape == (5, 3, 2) and len(rec.data) == 60
    assert torch.equal(moe.routing_tensor(rec), t.to(torch.int16))
    s = Sample(tokens=[1, 2, 3, 4, 5, 6], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -2.0])
    s.set_routed_experts(rec)
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and back.routed_experts == rec
    assert pickle.loads(pickle.dumps(s)) == s
    assert Sample.from_dict(Sample().to_dict()).routed_experts is None


def test_a_long_sample_record_stays_compact():
    """4k tokens, 48 layers, top-8: 3 MB of bytes, about 4 MB as JSON."""
    rec = moe.routing_record(torch.randint(0, 128, (4095, 48, 8)))
    s = Sample(tokens=list(range(4096)), routed_experts=rec)
    s.validate()
    text = json.dumps(s.to_dict()["routed_experts"])
    assert len(rec.data) == 4095 * 48 * 8 * 2 and len(text) < 1.34 * len(rec.data) + 100


def test_set_routed_experts_pads_the_positions_the_engine_did_not_record():
    s = Sample(tokens=[1, 2, 3, 4, 5], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0], index=7)
    s.set_routed_experts(moe.routing_record(torch.full((2, 1, 2), 3)))
    got = moe.routing_tensor(s.routed_experts)
    assert got.shape == (4, 1, 2) and got[:2].eq(3).all() and got[2:].eq(-1).all()
    with pytest.raises(ValueError, match="sample 7: routed experts cover 5 positions"):
        s.set_routed_experts(moe.routing_record(torch.zeros(5, 1, 2)))
    s.set_routed_experts(None)
    assert s.routed_experts is None


def test_appending_turns_extends_the_record_with_unrecorded_positions():
    s = Sample(tokens=[1, 2, 3], token_versions=[])
    s.set_routed_experts(moe.routing_record(torch.ones(2, 2, 2)))
    s.append_policy([4, 5], [-0.1, -0.2], version=0)
    s.append_env([6])
    s.validate()
    got = moe.routing_tensor(s.routed_experts)
    assert got.shape == (5, 2, 2) and got[:2].eq(1).all() and got[2:].eq(-1).all()
    s.set_routed_experts(moe.routing_record(torch.full((5, 2, 2), 2)))  # the final request's record
    assert moe.routing_tensor(s.routed_experts).eq(2).all()


def test_validate_rejects_a_record_of_the_wrong_length():
    s = Sample(tokens=[1, 2, 3], routed_experts=RoutedExperts((3, 1, 1), b"\0" * 6))
    with pytest.raises(ValueError, match="routed_experts covers 3 positions, expected len\\(tokens\\) - 1 = 2"):
        s.validate()
    with pytest.raises(ValueError, match="needs 6 bytes"):
        RoutedExperts((3, 1, 1), b"\0" * 4)
