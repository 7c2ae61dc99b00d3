"""Low-precision rollout weights (`engine.quantization`, `tidal.engine.quant`): the rounding by
hand, the engine computing exactly the rounded model, re-quantization after every kind of weight
change, and the loop training on quantized samples with the importance correction."""

from __future__ import annotations

import pytest
import torch
from conftest import loop_config, make_model, make_moe_model

import tidal.loop
from tidal.config import build_config
from tidal.contracts import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.quant import (
    PACKED,
    PACKED_MAX_ROWS,
    QuantizedLinear,
    Quantizer,
    check_quantization,
    dequantized,
    fp8_linear,
    project,
    quantize_fp8,
    quantize_int8,
)
from tidal.options import ConfigError

CPU_KINDS = ("fp16", "int8")
PROMPTS = [[5, 9, 14, 3, 7], [5, 9, 14, 3, 8, 11, 6], [20, 21]]


def test_int8_rounding_by_hand():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.1, 0.2, -0.4]])
    q, scale = quantize_int8(w)
    # row 0: s = 1/127, w/s = 127, -63.5, 31.75; row 1: s = 0.4/127, w/s = 31.75, 63.5, -127
    # (torch.round rounds halves to even: -63.5 -> -64, 63.5 -> 64)
    assert q.tolist() == [[127, -64, 32], [32, 64, -127]]
    assert scale.tolist() == pytest.approx([1 / 127, 0.4 / 127], rel=1e-6)
    x = torch.tensor([[2.0, 1.0, -1.0]])
    lin = torch.nn.Linear(3, 2, bias=True)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(torch.tensor([0.5, -1.0]))
    layer = QuantizedLinear(lin, "int8")
    want = [(2 * 127 - 64 - 32) / 127 + 0.5, (2 * 32 + 64 + 127) * 0.4 / 127 - 1.0]
    assert layer(x)[0].tolist() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_a_layer_computes_with_its_rounded_weight(kind):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80, bias=True)
    x = torch.randn(2, 7, 96)
    layer = QuantizedLinear(lin, kind)
    y = layer(x)
    w = dequantized(layer)
    exact = torch.nn.functional.linear(x, w, lin.bias)
    assert y.shape == (2, 7, 80) and y.dtype == x.dtype
    torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4)
    # the rounding is real and as small as its format allows
    err = (w - lin.weight.detach()).abs()
    bound = {"fp16": 2**-11, "int8": 0.5 / 127}[kind] * float(lin.weight.detach().abs().max())
    assert 0 < float(err.max()) <= bound * 1.001


def rounded_copy(model, quant: Quantizer):
    """`model` with each quantized layer's weight replaced by the weight the engine computes with."""
    import copy

    ref = copy.deepcopy(model)
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for name, layer in quant.layers.items():
            old = mods[name].weight
            mods[name].weight = torch.nn.Parameter(dequantized(layer).to(old.device, old.dtype))
    return ref.eval()


def forward_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens], device=model.device)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1).cpu()
    return lp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]


def sample(engine, seed=0, n=12):
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed + i) for i in range(len(PROMPTS))]
    return engine.generate_batch(PROMPTS, params)


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_the_engine_samples_from_the_rounded_model(kind):
    model = make_model(seed=1)
    engine = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512, quantization=kind)
    quant = engine.quant
    # every projection and the output head; the tied embedding stays full precision
    assert len(quant.layers) == 2 * 7 + 1 and "lm_head" in quant.layers
    # int8: a 4-byte scale per row of 64 on top
    assert quant.weight_bytes()[0] < quant.weight_bytes()[1] * {"fp16": 0.51, "int8": 0.3}[kind]
    ref = rounded_copy(model, quant)
    gap = []
    for prompt, out in zip(PROMPTS, sample(engine), strict=True):
        got = torch.tensor(out.log_probs)
        torch.testing.assert_close(got, forward_logprobs(ref, prompt, out.token_ids), rtol=0, atol=1e-4)
        gap.append((got - forward_logprobs(model, prompt, out.token_ids)).abs())
    assert float(torch.cat(gap).max()) > 1e-6  # it is not the full-precision model


def test_packed_weights_compute_the_full_precision_model():
    """fp32 on a CPU packs for oneDNN by default: the same model (the products summed in another
    order), sampled exactly like the unpacked engine; a call of more rows runs on the parameters."""
    model = make_model(seed=1)
    packed = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512)
    plain = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512, pack_weights=False)
    assert plain.quant is None and len(packed.quant.layers) == 2 * 7 + 1
    assert all(lay.kind == PACKED for lay in packed.quant.layers.values())
    assert packed.quant.weight_bytes()[0] == packed.quant.weight_bytes()[1]  # a copy, not a rounding
    outs, plain_outs = sample(packed), sample(plain)
    for prompt, out, ref in zip(PROMPTS, outs, plain_outs, strict=True):
        assert out.token_ids == ref.token_ids
        got = torch.tensor(out.log_probs)
        torch.testing.assert_close(got, torch.tensor(ref.log_probs), rtol=0, atol=1e-5)
        torch.testing.assert_close(got, forward_logprobs(model, prompt, out.token_ids), rtol=0, atol=1e-4)
    layer = packed.quant.layers["model.layers.0.mlp.down_proj"]
    x = torch.randn(PACKED_MAX_ROWS + 1, layer.mod.in_features)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.mod.weight))  # MKL on the parameter
    torch.testing.assert_close(layer(x[:3]), torch.nn.functional.linear(x[:3], layer.mod.weight))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q/k/v
def test_joined_layers_give_each_layers_own_bits(family):
    """A layer's q/k/v and an MLP's gate/up run as one packed product whose columns are each
    layer's packed product, bit for bit, biases included; a part changed in place re-packs it."""
    from families import tiny_model

    model = tiny_model(family)
    quant = Quantizer(model, PACKED)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert len(quant.joined) == 2 * len(model.model.layers)
    assert (attn.q_proj.bias is not None) == (family == "qwen2")
    torch.manual_seed(3)
    with torch.inference_mode():
        for mods in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            for rows in (1, 7, 32):
                x = torch.randn(rows, mods[0].in_features)
                joined = project(mods, x)
                assert len(joined) == len(mods) and mods[0].forward.joined is not None
                for y, m in zip(joined, mods, strict=True):
                    assert torch.equal(y, QuantizedLinear(m, PACKED)(x))
        with torch.no_grad():
            attn.k_proj.weight.mul_(2)
        x = torch.randn(5, attn.k_proj.in_features)
        k = project((attn.q_proj, attn.k_proj, attn.v_proj), x)[1]
        assert torch.equal(k, QuantizedLinear(attn.k_proj, PACKED)(x))  # packed from the doubled weight


def test_joined_layers_step_aside_for_a_replaced_part_and_for_many_rows():
    """A trainer's LoRA layer given to the engine replaces one of the parts: each then runs its own
    forward; more rows than the packed limit run MKL on the parameters."""
    model = make_model(seed=1)
    Quantizer(model, PACKED)
    attn = model.model.layers[0].self_attn
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(PACKED_MAX_ROWS + 1, attn.q_proj.in_features)
    with torch.inference_mode():
        for y, m in zip(project(mods, x), mods, strict=True):
            assert torch.equal(y, torch.nn.functional.linear(x, m.weight, m.bias))
        torch.manual_seed(6)
        attn.v_proj = torch.nn.Linear(attn.v_proj.in_features, attn.v_proj.out_features)
        mods = (attn.q_proj, attn.k_proj, attn.v_proj)
        q, k, v = project(mods, x[:4])
        assert torch.equal(v, attn.v_proj(x[:4])) and torch.equal(k, attn.k_proj.forward(x[:4]))


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of every nn.Linear weight of `model` (a tied output projection once per module)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)


def test_the_packed_copy_is_the_engines_only_extra_copy():
    """After packing, generating (transformers' prefill calls q, k and v one by one) and a weight
    load, the engine holds one packed copy of its linear weights: no joined part keeps one of its
    own, and what it computes is the unpacked engine's tokens."""
    engine = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512)
    plain = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512, pack_weights=False)
    layers, one_copy = engine.quant.layers, linear_bytes(engine.model)
    assert engine.quant.packed_bytes() == one_copy == engine.quant.weight_bytes()[0]
    params = [SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True) for _ in PROMPTS]
    outs = engine.generate_batch(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate_batch(PROMPTS, params)]
    assert not any(lay.packed is not None for lay in layers.values() if lay.joined is not None)
    assert engine.quant.packed_bytes() == one_copy == engine.quant.weight_bytes()[0]
    engine.update_weights_from_tensors(make_model(seed=2).named_parameters())
    assert engine.quant.packed_bytes() == one_copy
    for lay in (*engine.quant.joined, *(lay for lay in layers.values() if lay.joined is None)):
        assert lay.packed is not None and lay.key is not None


def test_parts_called_alone_give_their_own_packed_bits():
    """q, k and v called one by one on one input take their columns of the joined product: each
    layer's own packed bits; an input changed in place (or another input) computes it again."""
    model = make_model(seed=1)
    Quantizer(model, PACKED)
    attn = model.model.layers[0].self_attn
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    own = [QuantizedLinear(m, PACKED) for m in mods]
    torch.manual_seed(4)
    x = torch.randn(2, 5, attn.q_proj.in_features)
    with torch.no_grad():
        for m, ref in zip(mods, own, strict=True):
            assert torch.equal(m(x), ref(x))
        joined = mods[0].forward.joined
        assert joined.stash is None  # every part took its output
        attn.q_proj(x)
        assert set(joined.stash[2]) == {1, 2}
        held_k = joined.stash[2][1]
        x.mul_(2)  # k on the changed input: not the output computed before the change
        k = attn.k_proj(x)
        assert torch.equal(k, own[1](x)) and not torch.equal(k, held_k)
        y = x.clone()
        assert torch.equal(attn.v_proj(y), own[2](y))


def test_a_reload_frees_each_old_copy_before_packing_the_new(monkeypatch):
    """`refresh` drops a layer's old packed copy before it makes the new one, so a weight load
    never holds two copies of a layer at once; the new copies compute with the new weights."""
    import tidal.engine.quant as quant

    engine = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512)
    owners = {id(lay.mod.weight): lay for lay in engine.quant.layers.values() if lay.joined is None}
    owners.update({id(j.parts[0].mod.weight): j for j in engine.quant.joined})
    seen: list[bool] = []
    real = quant.pack

    def pack(w: torch.Tensor) -> torch.Tensor:
        held = [lay for lay in owners.values() if lay.packed is not None]
        seen.append(len(held) == len(owners) - 1)  # the one packing now has let go of its copy
        return real(w)

    monkeypatch.setattr(quant, "pack", pack)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one layer at a time: the count is exact
    fresh = LLMEngine(make_model(seed=2), dtype="float32", kv_cache_tokens=512, pack_weights=False)
    engine.update_weights_from_tensors(make_model(seed=2).named_parameters())
    assert len(seen) == len(owners) and all(seen)
    params = [SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True) for _ in PROMPTS]
    got, want = engine.generate_batch(PROMPTS, params), fresh.generate_batch(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_bfloat16_is_packed_where_the_cpu_computes_it(monkeypatch):
    """bf16 weights are packed only where bf16 is native (AVX512-BF16/AMX): there the packed
    engine decodes greedily to the unpacked engine's tokens, log-probs within bf16 rounding."""
    import tidal.engine.quant as quant
    from tidal.hardware import CPU, bf16_native

    cpu = torch.device(CPU)
    with monkeypatch.context() as m:
        m.setattr(quant, "bf16_native", lambda device: (False, "emulated"))
        assert not quant.packs(cpu, torch.bfloat16) and quant.packs(cpu, torch.float32)
    if not bf16_native(CPU)[0]:
        pytest.skip("this CPU emulates bf16: the engine does not pack it (checked above)")
    assert quant.packs(cpu, torch.bfloat16)
    packed, plain = (
        LLMEngine(make_model(seed=1), dtype="bfloat16", kv_cache_tokens=512, pack_weights=on) for on in (True, False)
    )
    assert plain.quant is None and all(lay.kind == PACKED for lay in packed.quant.layers.values())
    layer = packed.quant.layers["model.layers.0.mlp.down_proj"]
    x = torch.randn(5, layer.mod.in_features).bfloat16()
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.mod.weight), rtol=2**-7, atol=1e-3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True) for _ in PROMPTS]
    for out, ref in zip(packed.generate_batch(PROMPTS, params), plain.generate_batch(PROMPTS, params), strict=True):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(ref.log_probs), rtol=0, atol=3e-2)


def test_moe_routers_stay_full_precision():
    model = make_moe_model("qwen3_moe")
    engine = LLMEngine(model, dtype="float32", kv_cache_tokens=512, quantization="fp16")
    from tidal.moe import routers

    router_ids = {id(r) for r in routers(engine.model)}
    assert router_ids and not any(id(lay.mod) in router_ids for lay in engine.quant.layers.values())
    assert engine.quant.layers  # the attention projections are quantized


@pytest.mark.parametrize("kind", ["int8", "none"], ids=["int8", "packed"])
@pytest.mark.parametrize("share", [False, True], ids=["copied", "shared"])
def test_every_weight_change_is_requantized(share, kind):
    """After a load (copied or shared storage) and after an in-place change of the engine's
    parameters, the engine computes what a fresh quantized (or packed) engine on those weights does."""
    old, new = make_model(seed=1), make_model(seed=2)
    engine = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512, quantization=kind)
    fresh = LLMEngine(make_model(seed=2), dtype="float32", kv_cache_tokens=512, quantization=kind)
    assert engine.quant.layers["lm_head"].kind == (PACKED if kind == "none" else kind)
    want = [o.log_probs for o in sample(fresh)]
    before = [o.log_probs for o in sample(engine)]
    named = {n: p.detach().clone() for n, p in new.named_parameters()}
    engine.update_weights_from_tensors(named.items(), version=1, share=share)
    assert engine.stats()["quantize_s"] > 0
    assert [o.log_probs for o in sample(engine)] == want != before
    # weights changed in place through the engine's own parameters, no load: the next forward
    # sees them (their version moved)
    with torch.no_grad():
        for n, p in old.named_parameters():
            engine.model.get_parameter(n).copy_(p)
    engine.flush_cache()  # prefix K/V computed with the other weights (a load flushes them too)
    assert [o.log_probs for o in sample(engine)] == before


def test_sleep_drops_the_copies_and_a_sync_rebuilds_them():
    engine = LLMEngine(make_model(seed=1), dtype="float32", kv_cache_tokens=512, quantization="fp16")
    before = [o.log_probs for o in sample(engine)]
    engine.sleep()
    assert all(lay.packed is None for lay in engine.quant.layers.values())
    engine.wake()
    engine.update_weights_from_tensors(make_model(seed=1).named_parameters(), version=2)
    assert [o.log_probs for o in sample(engine)] == before


def test_errors_name_the_option():
    with pytest.raises(ValueError, match=r"engine.quantization: one of none, fp16, int8, fp8, got 'int4'"):
        check_quantization("int4", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"engine.quantization: int8 runs on the CPU, the engine is on meta; use fp8"):
        check_quantization("int8", torch.device("meta"))
    msg = r"engine.quantization: fp8 runs on CUDA GPUs, the engine is on cpu; use int8"
    with pytest.raises(ValueError, match=msg):
        check_quantization("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"engine quantization: one of none, fp16, int8, fp8, got 'q4'"):
        LLMEngine(make_model(), kv_cache_tokens=512, quantization="q4")
    with pytest.raises(ConfigError, match=r"engine.quantization: one of none, fp16, int8, fp8, got 'bf8'"):
        build_config(None, {"engine.quantization": "bf8"})
    with pytest.raises(ConfigError, match=r"engine.quantization: engine.kind hf runs none; got 'int8'"):
        build_config(None, {"engine.quantization": "int8", "engine.kind": "hf"})


def test_the_loop_trains_on_quantized_samples_with_the_correction(tiny_model_dir, tmp_path):
    over = {
        "train.num_steps": 3,
        "engine.quantization": "int8",
        "cluster.device": "cpu",  # int8 is a CPU format (on a GPU machine too)
        "algo.is_correction": "truncate",
        "algo.is_high": 2.0,
    }
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **over))
    assert len(history) == 3 and all(h["actor/grad_norm"] > 0 for h in history)
    # the engine's policy is the rounded one: the trainer sees a small, non-zero gap, and the
    # correction's weights are reported (an fp32 engine gives < 1e-4, tests/test_moe_loop.py)
    gaps = [h["actor/rollout_logprob_abs_diff"] for h in history]
    assert all(1e-5 < g < 0.2 for g in gaps), gaps
    assert all(any(k.startswith("is/") for k in h) for h in history)


def test_the_synchronous_loop_trains_without_the_engines_packed_copy(tiny_model_dir, tmp_path, monkeypatch):
    """The engine in the loop's process (fp32 on a CPU: packed) drops its packed copy while the
    trainer trains, and each push packs the trained weights again: one copy, made from the
    parameters the engine holds then (the trainer's, shared)."""
    from tidal.sync.local import InProcessSync
    from tidal.train.actor import Actor

    cores, during, after = [], [], []
    real_before, real_train, real_push = InProcessSync.before_train, Actor.train_step, InProcessSync.push

    def before_train(self):
        cores.append(self.engine.core)
        real_before(self)

    def train_step(self, *args, **kw):
        during.append(cores[-1].quant.packed_bytes())
        return real_train(self, *args, **kw)

    def push(self, version):
        out = real_push(self, version)
        quant = self.engine.core.quant
        current = all(
            lay.key == (lay.mod.weight.data_ptr(), lay.mod.weight._version)
            for lay in quant.layers.values()
            if lay.joined is None
        )
        after.append((quant.packed_bytes(), current))
        return out

    monkeypatch.setattr(InProcessSync, "before_train", before_train)
    monkeypatch.setattr(Actor, "train_step", train_step)
    monkeypatch.setattr(InProcessSync, "push", push)
    history = tidal.loop.train(loop_config(tiny_model_dir, tmp_path, **{"train.num_steps": 2, "cluster.device": "cpu"}))
    assert len(history) == 2
    one_copy = linear_bytes(cores[0].model)
    assert during == [0, 0]
    assert after == [(one_copy, True)] * 3  # the first push, then one after each step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8 runs on a CUDA GPU")
def test_fp8_on_a_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    torch.manual_seed(0)
    w = torch.randn(64, 96, device="cuda")
    x = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_fp8(w)
    y = fp8_linear(x, wq, ws, None)
    exact = x.float() @ w.t()
    assert y.dtype == torch.bfloat16 and float((y.float() - exact).norm() / exact.norm()) < 0.08
    model = make_model(seed=1, hidden_size=64, intermediate_size=128)
    engine = LLMEngine(model, dtype="bfloat16", kv_cache_tokens=512, quantization="fp8", device="cuda")
    assert len(engine.quant.layers) == 2 * 7 + 1  # vocab 320 and widths 64/128/32 are multiples of 16
    outs = sample(engine)
    assert all(len(o.token_ids) > 0 and all(lp <= 0 for lp in o.log_probs) for o in outs)
    ref = rounded_copy(make_model(seed=1).to("cuda", torch.bfloat16), engine.quant)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        got = torch.tensor(out.log_probs)
        want = forward_logprobs(ref, prompt, out.token_ids)
        assert float((got - want).abs().mean()) < 0.1  # bf16 activations rounded to fp8 per token


def test_the_rollout_config_turns_packing_off():
    from tidal.adapters.factory import core_options
    from tidal.backends import ENGINES

    cfg = build_config(None, {})
    assert core_options(cfg.engine, 512)["pack_weights"] is True
    cfg = build_config(None, {"engine.pack_weights": False})
    assert core_options(cfg.engine, 512)["pack_weights"] is False
    assert "pack_weights" in ENGINES["tidal"].core_options and "pack_weights" not in ENGINES["vllm"].core_options
    assert LLMEngine(make_model(), dtype="float32", kv_cache_tokens=512, pack_weights=False).quant is None
