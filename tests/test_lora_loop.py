"""LoRA through the whole loop on the tiny model: the engine rolls out with the merged adapters,
a sync moves only the targeted matrices, checkpoints hold the adapter, resume is exact, and
`tidal export` writes a merged model or a peft adapter folder."""

import json

import pytest
import torch
from conftest import loop_config, make_model, record_weight_versions, train_killed
from test_loop import stable
from transformers import AutoModelForCausalLM

import tidal.loop
from tidal.train.actor import Actor
from tidal.train.checkpoint import export_checkpoint

LORA = {"train.lora_rank": 4, "train.lora_alpha": 8.0, "train.lr": 1e-2}


def test_a_lora_run_rolls_out_with_its_adapters_and_syncs_only_them(tiny_model_dir, tmp_path, monkeypatch):
    versions = record_weight_versions(monkeypatch)
    # one optimizer step per rollout: the trainer scores each batch with the weights that sampled it
    over = {**LORA, "train.num_steps": 3, "algo.kl_coef": 0.1, "train.global_batch_size": 16}
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    assert versions == [{0}, {1}, {2}]
    # the trainer scored the engine's tokens as the engine did: the engine's merged weights are
    # the trained adapters (fp32: within 1e-4, as without LoRA)
    assert all(h["actor/rollout_logprob_abs_diff"] < 1e-4 for h in history)
    # the run's first push (version 0, before step 1) hands the engine every tensor, so it shares
    # the trainer's frozen base weights (one copy in memory); each step's sync then moves the 14
    # merged matrices of the tiny Llama (2 layers x q, k, v, o, gate, up, down)
    proj = sum(p.numel() for n, p in make_model().named_parameters() if n.endswith("_proj.weight"))
    assert [h["sync/tensors"] for h in history] == [14.0] * 3
    assert [h["sync/bytes"] for h in history] == [proj * 4.0] * 3
    assert all(h["loss/kl"] >= 0 for h in history) and history[-1]["loss/kl"] > 0
    ckpt = tmp_path / "checkpoints" / "step_3"
    assert sorted(p.name for p in ckpt.glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not list(ckpt.glob("model*.safetensors"))  # the adapter, not a copy of the base model
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)


def test_a_lora_run_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    over = {**LORA, "train.save_interval": 2, "algo.kl_coef": 0.1}
    full = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "full", **over))
    cut = loop_config(tiny_model_dir, tmp_path / "cut", **over)
    train_killed(cut, monkeypatch)
    resumed = tidal.loop.train(cut, resume=True)
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    assert stable(resumed) == stable(full)
    assert all(h["actor/grad_norm"] > 0 for h in full)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a transformers name deprecated in 5.x
def test_export_writes_a_merged_model_or_a_peft_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel

    run = tmp_path / "run"
    tidal.loop.train(loop_config(tiny_model_dir, run, **{**LORA, "train.num_steps": 2}))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cfg = loop_config(tiny_model_dir, run, **LORA)
    actor = Actor(run / "checkpoints" / "step_2", cfg.train, cfg.algo, reference=tiny_model_dir)
    with torch.no_grad():
        want = actor.model.eval()(ids).logits

    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(run, tmp_path / "merged")).eval()
    adapter = export_checkpoint(run, tmp_path / "adapter", lora="adapter")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(adapter)).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").exists() and (adapter / "tokenizer.json").exists()
    assert not list((tmp_path / "merged").glob("adapter_*"))


def test_export_of_a_full_run_refuses_lora(tiny_model_dir, tmp_path):
    tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "run", **{"train.num_steps": 1}))
    with pytest.raises(ValueError, match=r"--lora adapter: .*step_1 holds a full model, not a LoRA adapter"):
        export_checkpoint(tmp_path / "run", tmp_path / "out", lora="adapter")


def test_the_delta_transport_sends_what_changed_and_the_engine_checks_the_whole_model(tokenizer):
    """`cluster.weight_sync: delta` to a tidal server: the first push sends every tensor, later
    ones only the merged LoRA matrices, as a partial update; the server's checksum of its whole
    model matches the trainer's after each push, and a full fine-tuning push changes everything."""
    from conftest import make_samples

    from tidal.adapters.async_engine import AsyncEngine
    from tidal.adapters.client import EngineClient
    from tidal.aio import LoopThread
    from tidal.algo.options import AlgoConfig
    from tidal.engine.llm_engine import LLMEngine
    from tidal.server.app import BackgroundServer, build_app
    from tidal.sync.remote import HttpSync
    from tidal.train.options import TrainConfig

    engine = AsyncEngine(LLMEngine(make_model(seed=0), tokenizer, dtype="float32", block_size=4, kv_cache_tokens=256))
    server = BackgroundServer(build_app(engine, "tiny")).start()
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, lr=1e-2, dtype="float32", lora_rank=4)
    actor = Actor(make_model(seed=0), cfg, AlgoConfig(), temperature=0.8)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
    all_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    proj = sum(p.numel() * 4 for n, p in make_model().named_parameters() if n.endswith("_proj.weight"))
    try:
        with LoopThread() as loop:
            sync = HttpSync(actor, [EngineClient(server.url, 60)], 60, delta=True, loop=loop)
            sent = []
            for version in (1, 2, 3):
                actor.train_step(make_samples(), adv)
                m = sync.push(version)  # checked: the server's whole-model checksum is the trainer's
                sent.append((m["sync/tensors"], m["sync/bytes"]))
                assert engine.weight_version == version
            assert sent == [(20.0, float(all_bytes)), (14.0, float(proj)), (14.0, float(proj))]
            got = dict(engine.core.model.named_parameters())
            for name, t in actor.named_weights():
                assert torch.equal(got[name], t), name
    finally:
        server.stop()
        engine.close()


def test_ppo_with_lora_trains_the_actor_and_critic_adapters(tiny_model_dir, tmp_path):
    over = {**LORA, "train.num_steps": 2, "algo.advantage": "ppo", "algo.critic_lr": 1e-2}
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    assert all(h["critic/grad_norm"] >= 0 and h["actor/grad_norm"] > 0 for h in history)
    assert history[-1]["critic/grad_norm"] > 0  # the head moved on step 1; the adapters see a gradient on step 2


def test_sft_with_lora_learns_and_saves_an_adapter(tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "yes"}]} for i in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = {**LORA, "algo.mode": "sft", "data.path": str(data), "train.num_steps": 10, "train.lr": 3e-3}
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path / "run", **over))
    nll = [h["loss/sft"] for h in history]
    # with its tied embedding frozen the tiny model's logits stay small (a plain peft model on it
    # levels off near 4.5 nats too), so the adapters only bring the NLL steadily down
    assert all(b < a for a, b in zip(nll, nll[1:], strict=False)) and nll[-1] < nll[0] - 0.5, nll
    assert (tmp_path / "run" / "checkpoints" / "step_10" / "adapter_model.safetensors").exists()


def test_an_unmerged_lora_run_samples_with_the_trainers_own_adapters(tiny_model_dir, tmp_path):
    over = {**LORA, "train.lora_merge": False, "train.num_steps": 2, "train.global_batch_size": 16}
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    assert [h["sync/bytes"] for h in history] == [0.0, 0.0]  # shared: the adapters are the engine's own
    assert all(h["actor/rollout_logprob_abs_diff"] < 1e-4 and h["actor/grad_norm"] > 0 for h in history)


def test_unmerged_lora_needs_the_in_process_engine(tiny_model_dir, tmp_path):
    from tidal.options import ConfigError

    with pytest.raises(ConfigError, match="train.lora_merge: false shares the trainer's LoRA model"):
        loop_config(tiny_model_dir, tmp_path, **{**LORA, "train.lora_merge": False, "cluster.engines": 2})
