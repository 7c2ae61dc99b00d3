"""LoRA (`train.lora_rank` > 0): only the adapters train, the reference is the policy with its
adapters off, engines get `W + s · B A`, and the adapter saves and loads as peft's folder."""

import pytest
import torch
from conftest import make_model, make_samples

from tidal.algo.options import AlgoConfig
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.train import lora
from tidal.train.actor import Actor
from tidal.train.options import TrainConfig

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])


def lora_cfg(**kw):
    base = dict(micro_batch_size=4, global_batch_size=8, lr=1e-2, dtype="float32", lora_rank=4, lora_alpha=8.0)
    return TrainConfig(**{**base, **kw})


def trained_actor(cfg=None, steps=1, **algo):
    actor = Actor(make_model(seed=0), cfg or lora_cfg(), AlgoConfig(**algo), temperature=0.8)
    for _ in range(steps):
        actor.train_step(make_samples(), ADV)
    return actor


def test_only_the_adapters_train_and_the_base_weights_do_not_move():
    actor = trained_actor()
    base = dict(make_model(seed=0).named_parameters())
    names = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # q, k, v, o, gate, up, down in each of the 2 layers, an A and a B each
    assert len(names) == 2 * 7 * 2
    assert {id(p) for p in actor.params} == {id(p) for n, p in actor.model.named_parameters() if p.requires_grad}
    for name, p in actor.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base[lora.base_name(name)]), name
    # AdamW holds state for the adapters alone
    assert len(actor.optimizer.state) == len(names)


def test_step_zero_is_the_base_model_and_adapters_off_is_the_base_model_after_training():
    samples = make_samples()
    plain = Actor(make_model(seed=0), lora_cfg(lora_rank=0), AlgoConfig(), temperature=0.8)
    base_lp = plain.compute_log_probs(samples)
    actor = Actor(make_model(seed=0), lora_cfg(), AlgoConfig(kl_coef=0.1), temperature=0.8)
    assert actor.ref is None and actor.has_reference  # no second copy of the model
    assert torch.equal(actor.compute_log_probs(samples), base_lp)  # B = 0 at the start
    actor.train_step(samples, ADV)
    moved = actor.compute_log_probs(samples)
    assert (moved - base_lp).abs().max() > 1e-3
    assert torch.equal(actor.compute_log_probs(samples, "reference"), base_lp)
    # and the adapters are back on (and trainable) after the reference pass
    assert torch.equal(actor.compute_log_probs(samples), moved)
    assert all(p.requires_grad for p in actor.params)


def test_kl_loss_is_zero_at_step_zero_and_positive_after():
    actor = Actor(make_model(seed=0), lora_cfg(), AlgoConfig(kl_coef=0.5), temperature=0.8)
    assert actor.train_step(make_samples(), ADV)["loss/kl"] == pytest.approx(0.0, abs=1e-7)
    assert actor.train_step(make_samples(), ADV)["loss/kl"] > 1e-6


def test_merged_weights_are_w_plus_scale_b_a_under_the_base_names():
    actor = trained_actor()
    merged = dict(actor.named_weights())
    base = dict(make_model(seed=0).named_parameters())
    assert merged.keys() == base.keys()
    q = actor.model.model.layers[1].self_attn.q_proj
    a, b = q.lora_A["default"].weight, q.lora_B["default"].weight
    assert b.abs().max() > 0  # trained
    want = base["model.layers.1.self_attn.q_proj.weight"] + (8.0 / 4) * (b @ a)
    torch.testing.assert_close(merged["model.layers.1.self_attn.q_proj.weight"], want, rtol=0, atol=1e-6)
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])
    changed = dict(actor.named_weights(changed_only=True))
    assert len(changed) == 14 and all(k.endswith("_proj.weight") for k in changed)
    for k, v in changed.items():
        assert torch.equal(v, merged[k])


def engine_gap(actor, core) -> float:
    """The largest gap between the log-probs an engine core reports for 8 tokens it samples and
    the trainer's log-probs of those tokens."""
    from tidal.types import Sample

    outs = {}
    core.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.8, max_new_tokens=8, seed=3))
    while core.has_unfinished():
        for o in core.step():
            outs[o.request_id] = o
    out = outs["a"]
    s = Sample(tokens=[5, 6, 7, 8, *out.token_ids], response_length=len(out.token_ids))
    s.loss_mask, s.rollout_log_probs = [1] * s.response_length, list(out.log_probs)
    return float((actor.compute_log_probs([s])[0, : s.response_length] - torch.tensor(out.log_probs)).abs().max())


def test_an_engine_with_the_merged_weights_scores_like_the_trainer(tokenizer):
    actor = trained_actor(steps=2)
    engine = LLMEngine(make_model(seed=0), tokenizer, dtype="float32", block_size=4, kv_cache_tokens=256)
    # only the targeted matrices travel: the engine keeps its base weights for the rest
    engine.update_weights_from_tensors(actor.named_weights(changed_only=True), version=1, partial=True)
    assert engine_gap(actor, engine) < 1e-4


def test_a_wrong_target_module_names_the_linear_layers_the_model_has():
    with pytest.raises(lora.LoraError) as e:
        Actor(make_model(), lora_cfg(lora_target_modules=["q_proj", "qkv"]), AlgoConfig())
    assert str(e.value) == (
        "train.lora_target_modules: 'qkv' name no linear layer of the model; its linear layers are "
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or use all-linear)"
    )


def test_named_targets_only_get_adapters():
    actor = Actor(make_model(), lora_cfg(lora_target_modules=["q_proj", "v_proj"]), AlgoConfig())
    assert sorted(p.rpartition(".")[2] for p in lora.lora_layers(actor.model)) == ["q_proj"] * 2 + ["v_proj"] * 2
    assert len(dict(actor.named_weights(changed_only=True))) == 4


# all-linear on models peft would otherwise wrap past what tidal merges: an MoE block's fused
# expert tensors (Qwen3-MoE; Qwen3-Next also has GDN layers), Mamba-2's out_proj (Falcon-H1)
ALL_LINEAR = {
    "qwen3_moe": ["k_proj", "o_proj", "q_proj", "v_proj"],
    "qwen3_next": [
        "in_proj_ba",
        "in_proj_qkvz",
        "k_proj",
        "o_proj",
        "out_proj",
        "q_proj",
        "shared_expert_gate",
        "v_proj",
    ],
    "falcon_h1": ["down_proj", "gate_proj", "in_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
}


@pytest.mark.parametrize("family", ALL_LINEAR)
def test_all_linear_leaves_out_fused_experts_and_mamba_out_proj_and_the_engine_scores_alike(family, tokenizer):
    from families import tiny_model

    actor = Actor(tiny_model(family), lora_cfg(), AlgoConfig(), temperature=0.8)
    assert sorted({p.rpartition(".")[2] for p in lora.lora_layers(actor.model)}) == ALL_LINEAR[family]
    actor.train_step(make_samples(), ADV)
    engine = LLMEngine(tiny_model(family), tokenizer, dtype="float32", block_size=4, kv_cache_tokens=256)
    engine.update_weights_from_tensors(actor.named_weights(changed_only=True), version=1, partial=True)
    assert engine_gap(actor, engine) < 1e-4


def test_a_target_that_names_fused_experts_is_refused():
    from families import tiny_model

    with pytest.raises(lora.LoraError) as e:
        Actor(tiny_model("qwen3_moe"), lora_cfg(lora_target_modules=["q_proj", "down_proj"]), AlgoConfig())
    assert str(e.value) == (
        "train.lora_target_modules: 'down_proj' would adapt the model's fused expert tensors (peft maps those "
        "names onto them), which tidal cannot merge into an engine's weights; leave them out (all-linear does)"
    )


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a transformers name deprecated in 5.x
def test_the_adapter_round_trips_through_peft(tmp_path):
    from peft import PeftModel

    actor = trained_actor()
    base_dir = tmp_path / "base"
    make_model(seed=0).save_pretrained(base_dir)
    actor.base = str(base_dir)
    actor.save_model(tmp_path / "adapter")
    assert lora.is_adapter(tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(make_model(seed=0), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        want = actor.model.eval()(ids).logits
        got = peft_model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # and back into tidal: an actor started from the folder holds the same adapters
    again = Actor(make_model(seed=0), lora_cfg(lora_adapter=str(tmp_path / "adapter")), AlgoConfig())
    for (n, p), (m, q) in zip(actor.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n


def test_an_adapter_of_another_rank_is_refused_naming_the_file(tmp_path):
    actor = trained_actor()
    actor.save_model(tmp_path / "adapter")
    with pytest.raises(
        lora.LoraError,
        match=r"adapter_model.safetensors: base_model.model.model.layers.0.mlp.down_proj.lora_A.weight "
        r"has shape \(4, 128\), the model's is \(8, 128\) \(the folder's rank is 4\)$",
    ):
        Actor(make_model(seed=0), lora_cfg(lora_rank=8, lora_adapter=str(tmp_path / "adapter")), AlgoConfig())


def test_a_lora_critic_trains_its_adapters_and_its_whole_value_head(tiny_model_dir):
    from tidal.train.critic import Critic

    critic = Critic(tiny_model_dir, lora_cfg(), AlgoConfig(critic_lr=1e-2))
    trained = {n for n, p in critic.module.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trained
    assert all(n.startswith("head.") or ".lora_" in n for n in trained)
    assert not lora.lora_layers(critic.module.head) and len(lora.lora_layers(critic.module)) == 14
    samples = make_samples()
    before = {n: p.detach().clone() for n, p in critic.module.named_parameters()}
    returns = torch.ones(8, max(s.response_length for s in samples))
    for _ in range(2):  # the zero-initialised head passes no gradient back on the first step
        m = critic.train_step(samples, returns, critic.values(samples))
        assert m["critic/grad_norm"] > 0
    for n, p in critic.module.named_parameters():
        # frozen weights stay; the head and every B move (A moves once B is not zero: a step later)
        assert torch.equal(p, before[n]) == (n not in trained or ".lora_A." in n), n


def test_in_process_sync_shares_the_base_weights_once_then_moves_the_merged_matrices(tokenizer):
    from tidal.adapters.async_engine import AsyncEngine
    from tidal.sync.local import InProcessSync

    actor = Actor(make_model(seed=0), lora_cfg(), AlgoConfig(), temperature=0.8)
    engine = AsyncEngine(LLMEngine(make_model(seed=0), tokenizer, dtype="float32", block_size=4, kv_cache_tokens=256))
    try:
        sync = InProcessSync(actor, engine)
        first = sync.push(0)
        held = dict(engine.core.model.named_parameters())
        base = dict(actor.model.named_parameters())
        # one copy in memory: the engine holds the trainer's own frozen tensors
        assert held["model.norm.weight"].data_ptr() == base["model.norm.weight"].data_ptr()
        assert held["model.embed_tokens.weight"].data_ptr() == base["model.embed_tokens.weight"].data_ptr()
        actor.train_step(make_samples(), ADV)
        second = sync.push(1)
        assert (first["sync/tensors"], second["sync/tensors"]) == (20.0, 14.0)
        proj = sum(p.numel() * 4 for n, p in make_model().named_parameters() if n.endswith("_proj.weight"))
        assert second["sync/bytes"] == proj
        held = dict(engine.core.model.named_parameters())
        for name, t in actor.named_weights():
            assert torch.equal(held[name], t), name
        assert engine.weight_version == 1
    finally:
        engine.close()


def test_unmerged_the_engine_runs_the_trainers_own_lora_tensors(tokenizer):
    """`train.lora_merge: false`: the in-process engine gets the trainer's LoRA layers and shares
    every tensor (base and adapters): nothing is copied, later pushes name only the adapters,
    and the engine samples what the trainer scores."""
    from tidal.adapters.async_engine import AsyncEngine
    from tidal.sync.local import InProcessSync

    actor = Actor(make_model(seed=0), lora_cfg(lora_merge=False), AlgoConfig(), temperature=0.8)
    core = LLMEngine(make_model(seed=0), tokenizer, dtype="float32", block_size=4, kv_cache_tokens=256)
    engine = AsyncEngine(core)
    try:
        sync = InProcessSync(actor, engine, merged=False, adopt=lambda c: lora.mirror(c.model, actor.model))
        sync.push(0)
        held, trained = dict(core.model.named_parameters()), dict(actor.model.named_parameters())
        assert held.keys() == trained.keys()
        assert all(held[n].data_ptr() == p.data_ptr() for n, p in trained.items())  # one copy of everything
        actor.train_step(make_samples(), ADV)
        m = sync.push(1)
        assert m == {"sync/bytes": 0.0, "sync/tensors": 28.0}  # the adapters, already the engine's own
        engine.call(lambda: None, 60)  # the engine thread is idle: the core can be stepped from here
        assert engine_gap(actor, core) < 1e-4
    finally:
        engine.close()
