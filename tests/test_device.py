"""One code path for every device, checked on a CPU.

A CPU cannot tell `cpu` from `cuda`, but it can tell a tensor made on the device tidal resolved
from one made on torch's *default* device: here the default device is `meta` while tidal computes
on `cpu`, so any tensor created without naming its device lands on `meta`, and the first op mixing
it with the real ones raises. The trainer's step (forward, loss, backward, optimizer) and the
engine's prefill, decode and sampling run this way; on a GPU the same code keeps every tensor on
the GPU (and host-side tensors on the host, where they are made on purpose). Autograd runs a custom
Function's backward outside that mode, so those are checked with their tensors on `meta` itself
(tests/train/test_logits.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import make_model, make_samples, make_tokenizer
from tidal import hardware
from tidal.algo.options import AlgoConfig
from tidal.train.options import TrainConfig

TIDAL = Path(__file__).resolve().parents[1] / "tidal"


def test_meta_default_device_catches_a_tensor_made_without_a_device():
    """The check itself: under a `meta` default, an unplaced tensor mixed with the device's raises."""
    x = torch.ones(3, device=hardware.CPU)
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta"):
        x + torch.ones(3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "autocast"])
@pytest.mark.parametrize("packing", [True, False])
def test_the_trainer_step_makes_every_tensor_on_its_device(dtype, packing):
    from tidal.train.actor import Actor

    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, lr=1e-3, dtype=dtype, packing=packing)
    actor = Actor(make_model(seed=0), cfg, AlgoConfig(kl_coef=0.1), temperature=0.8, device=hardware.CPU)
    samples = make_samples()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
    before = [p.detach().clone() for p in actor.params]
    with torch.device("meta"):
        old = actor.compute_log_probs(samples)
        ref = actor.compute_log_probs(samples, "reference")
        m = actor.train_step(samples, adv, old, ref)
    assert old.device.type == "cpu" and torch.isfinite(old).all()
    assert m["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, actor.params, strict=True))


@pytest.mark.parametrize("packing", [True, False])
def test_the_trainer_step_under_routing_replay_makes_every_tensor_on_its_device(packing):
    from tests.conftest import make_moe_model
    from tidal import moe
    from tidal.train.actor import Actor

    samples = make_samples()
    recorder = make_moe_model("qwen3_moe")
    with torch.no_grad(), moe.capture(recorder) as rec:
        for s in samples:
            recorder(torch.tensor([s.tokens]))
            s.set_routed_experts(moe.routing_record(rec.take()[:-1]))
    cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, lr=1e-3, dtype="float32", packing=packing)
    actor = Actor(make_moe_model("qwen3_moe"), cfg, AlgoConfig(routing_replay=True), device=hardware.CPU)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25])
    with torch.device("meta"):
        old = actor.compute_log_probs(samples)
        m = actor.train_step(samples, adv, old)
    assert old.device.type == "cpu" and torch.isfinite(old).all()
    assert m["actor/grad_norm"] > 0


def test_the_engine_prefills_decodes_and_samples_on_its_device():
    from tidal.contracts import SamplingParams
    from tidal.engine.llm_engine import LLMEngine

    engine = LLMEngine(make_model(seed=1), make_tokenizer(), dtype="float32", kv_cache_tokens=512, device=hardware.CPU)
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [10, 11, 12]]
    params = [
        SamplingParams(max_new_tokens=6, temperature=0.9, seed=1, top_logprobs=2),
        SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=20, min_p=0.01, seed=2),
        SamplingParams(
            max_new_tokens=6, temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 1.0}
        ),
    ]
    with torch.device("meta"):
        outs = engine.generate_batch(prompts, params)
    expected = engine.generate_batch(prompts, params)  # the same seeds outside the check
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(len(o.token_ids) >= 1 for o in outs)


def _device_literals(path: Path) -> list[str]:
    """`"cpu"` / `"cuda"` / `"cuda:N"` string constants in a module, with their line numbers, but
    for the one tuple of `cluster.device` choices the config validates (`DEVICES`)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["DEVICES"]:
            node.value = ast.Tuple(elts=[], ctx=ast.Load())  # the choices themselves
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"(cpu|cuda|cuda:\d+|mps|xpu)", node.value):
                found.append(f"{path.relative_to(TIDAL.parent)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_names_a_device_outside_hardware():
    """Devices are resolved in `tidal/hardware.py` only; everything else takes the resolved one."""
    allowed = {TIDAL / "hardware.py"}
    found = [hit for p in sorted(TIDAL.rglob("*.py")) if p not in allowed for hit in _device_literals(p)]
    assert found == []


@pytest.mark.parametrize(
    ("device", "backend", "autocast"),
    [("cpu", "gloo", "cpu"), ("cuda", "cpu:gloo,cuda:nccl", "cuda"), ("cuda:1", "cpu:gloo,cuda:nccl", "cuda")],
)
def test_backend_and_autocast_follow_the_device(device, backend, autocast):
    assert hardware.dist_backend(device) == backend
    assert hardware.autocast_type(device) == autocast


def test_auto_resolves_to_cuda_only_where_torch_sees_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hardware.resolve_device("auto").device == "cpu"
    with pytest.raises(ValueError, match=r"cluster.device: cuda, but torch .* sees no CUDA device"):
        hardware.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    choice = hardware.resolve_device("auto")
    assert choice == hardware.DeviceChoice("cuda", "auto: torch sees 2 CUDA device(s)")
    assert hardware.resolve_device("cpu").device == "cpu"
    with pytest.raises(ValueError, match=r"cluster.device: one of auto, cpu, cuda, got 'tpu'"):
        hardware.resolve_device("tpu")


def test_bind_device_takes_the_first_visible_gpu_or_the_local_rank(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert hardware.bind_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert hardware.bind_device("cuda") == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert hardware.bind_device("cpu") == torch.device("cpu") and len(chosen) == 2


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ({}, (0.0, 0.0)),
        ({"gpus_per_trainer": 1, "gpus_per_engine": 1}, (1, 1)),
        ({"colocate": True}, (0.0, 0.0)),
        ({"colocate": True, "gpus_per_trainer": 1}, (0.5, 0.5)),
        ({"colocate": True, "gpus_per_trainer": 2, "gpus_per_engine": 1}, (1.0, 1.0)),
    ],
)
def test_colocated_trainer_and_engine_ask_for_a_share_of_the_same_gpus(cluster, expected):
    """Ray hides every GPU from an actor that asked for none: a colocated engine asking for 0 could
    not see the GPU its trainer rank frees for it."""
    from tidal.cluster.options import ClusterConfig
    from tidal.cluster.ray_setup import actor_gpus

    assert actor_gpus(ClusterConfig(**cluster)) == expected


def test_the_run_records_the_device_and_resolves_the_dtypes_for_it(monkeypatch):
    """With CUDA faked present, `auto` resolves to it, config.json's record says why, and the
    dtypes are chosen for the GPU (bf16 where it supports it), not for the CPU."""
    from tidal.config import Config
    from tidal.loop import resolve_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Faked GPU")
    cfg, record = resolve_precision(Config())
    assert cfg.cluster.device == "cuda"
    assert record["cluster.device"] == {
        "requested": "auto",
        "device": "cuda",
        "reason": "auto: torch sees 1 CUDA device(s)",
    }
    assert (cfg.train.dtype, cfg.engine.dtype) == ("bfloat16", "bfloat16")
    assert "Faked GPU computes bf16" in record["train.dtype"]["reason"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg, record = resolve_precision(Config())
    assert cfg.cluster.device == "cpu" and record["cluster.device"]["reason"] == "auto: torch sees no CUDA device"


def test_batch_invariant_numerics_make_every_tensor_on_their_device(monkeypatch):
    """Both strategies of `tidal.invariant` (a CPU's padded rows, a GPU's float64 products and
    reductions, routed through here): the engine's steps and the trainer's scoring."""
    from tidal import invariant
    from tidal.contracts import SamplingParams
    from tidal.engine.llm_engine import LLMEngine
    from tidal.train.actor import Actor

    for wide in (False, True):
        monkeypatch.setattr(invariant, "wide", lambda device, wide=wide: wide)
        engine = LLMEngine(make_model(seed=1), None, dtype="bfloat16", kv_cache_tokens=512, batch_invariant=True)
        params = [SamplingParams(max_new_tokens=5, temperature=0.9, seed=i) for i in range(2)]
        with torch.device("meta"):
            outs = engine.generate_batch([[5, 6, 7, 8, 9], [10, 11, 12]], params)
        assert [len(o.token_ids) for o in outs] == [5, 5]
        cfg = TrainConfig(micro_batch_size=4, global_batch_size=8, dtype="bfloat16", batch_invariant=True)
        actor = Actor(make_model(seed=0), cfg, AlgoConfig(), device=hardware.CPU)
        with torch.device("meta"):
            old = actor.compute_log_probs(make_samples())
        assert old.device.type == "cpu" and torch.isfinite(old).all()
