"""The decode path (`tidal.engine.decode_path`): pure decode steps of Llama-shaped families without
transformers' plumbing give the bits transformers' forward gives, are checked once against it,
and stay off for other families or when the check fails."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from families import WINDOW, tiny_model

from tidal.contracts import SamplingParams
from tidal.engine import decode_path, fused_kernels
from tidal.engine.decode_path import DecodePath
from tidal.engine.llm_engine import LLMEngine

PROMPTS = [[1, 5, 9], list(range(40, 60)), [7, 300, 17, 250, 99, 3, 64, 128, 190, 211, 16, 45], [11]]
assert max(len(p) for p in PROMPTS) > WINDOW + 10  # the windows act


def sampled(n: int = 10) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, max_new_tokens=n, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]


def engines(family: str, dtype: str) -> tuple[LLMEngine, LLMEngine]:
    """The same model twice: with the decode path, and without it (transformers' forward)."""
    on, off = (LLMEngine(tiny_model(family), None, dtype=dtype, block_size=4, kv_cache_tokens=512) for _ in range(2))
    off.runner.decode_path = None
    return on, off


@pytest.mark.parametrize(("family", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("mistral", "float32"),
                                               ("qwen2", "float32"), ("qwen2", "bfloat16"), ("qwen3", "float32"),
                                               ("qwen3", "bfloat16")])  # fmt: skip
def test_decode_steps_give_transformers_bits(family, dtype):
    on, off = engines(family, dtype)
    assert on.runner.decode_path is not None
    calls = []
    forward = on.model.forward
    on.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    got, want = on.generate_batch(PROMPTS, sampled()), off.generate_batch(PROMPTS, sampled())
    assert on.runner.decode_path_checked and on.runner.decode_path is not None
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.log_probs == w.log_probs  # exactly
    # transformers' forward ran for the prefill step and for the first decode step's check only
    assert len(calls) == 2 and on.stats()["steps"] == 10  # the prefill gives the first token


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe"])
def test_other_families_keep_transformers_forward(family):
    engine = LLMEngine(tiny_model(family), None, dtype="float32", kv_cache_tokens=256)
    assert engine.runner.decode_path is None


def test_a_failed_check_turns_it_off(monkeypatch, caplog):
    """A decode path whose logits differ from transformers' is dropped at the first decode step,
    and that step returns transformers' logits: the tokens are the plain engine's."""
    on, off = engines("llama", "float32")
    real = DecodePath.__call__
    monkeypatch.setattr(DecodePath, "__call__", lambda self, plan: real(self, plan) + 1e-3)
    with caplog.at_level(logging.WARNING, logger="tidal.engine.model_runner"):
        got = on.generate_batch(PROMPTS, sampled(6))
    assert on.runner.decode_path is None
    why = "max |difference| 0.001; on this device they must be equal"
    assert f"the decode path's logits differ from transformers' ({why}): kept off" in caplog.text
    want = off.generate_batch(PROMPTS, sampled(6))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.log_probs for o in got] == [o.log_probs for o in want]


def test_weights_loaded_after_start_reach_it():
    """It calls the modules' current forwards: new weights (and the engine's re-packing) apply."""
    on, off = engines("llama", "float32")
    on.generate_batch(PROMPTS, sampled(3))
    assert on.runner.decode_path_checked
    other = tiny_model("llama", seed=7).state_dict()
    for engine in (on, off):
        engine.update_weights_from_tensors(list(other.items()))
    got, want = on.generate_batch(PROMPTS, sampled()), off.generate_batch(PROMPTS, sampled())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.log_probs for o in got] == [o.log_probs for o in want]
    assert torch.equal(on.model.model.layers[0].mlp.up_proj.weight, other["model.layers.0.mlp.up_proj.weight"])


def test_modules_replaced_after_start_reach_it():
    """A projection swapped for another module after the check (as a trainer's LoRA layers are
    given to the engine) is the one the path calls; so is the torch rotary where C is off."""
    on, off = engines("llama", "float32")
    on.generate_batch(PROMPTS, sampled(3))
    assert on.runner.decode_path_checked
    torch.manual_seed(9)
    new = torch.nn.Linear(64, 64, bias=True)
    for engine in (on, off):
        engine.model.model.layers[1].self_attn.o_proj = copy.deepcopy(new)
    on.runner.decode_path.native_rope = False
    got, want = on.generate_batch(PROMPTS, sampled()), off.generate_batch(PROMPTS, sampled())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.log_probs for o in got] == [o.log_probs for o in want]


def test_the_checks_arithmetic():
    """`agrees`: equal bits always pass; on a GPU (not exact) the relative error of the batch,
    ‖fast − ref‖ / ‖ref‖, against 6·eps of the logits' dtype."""
    assert decode_path.rounding_tolerance(torch.bfloat16) == 6 * 2**-7  # 0.046875
    assert decode_path.rounding_tolerance(torch.float16) == 6 * 2**-10
    assert decode_path.rounding_tolerance(torch.float32) == 1e-4  # 6·2^-23 is below the floor
    ref = torch.ones(4, 10, dtype=torch.bfloat16)  # ‖ref‖ = √40
    assert decode_path.agrees(ref, ref.clone(), exact=True) == (True, "the same bits")
    near, far = ref.clone(), ref.clone()
    near[2, 3], far[2, 3] = 1.25, 1.5  # relative errors 0.25/√40 = 0.0395 and 0.5/√40 = 0.0791
    assert decode_path.relative_error(near, ref) == pytest.approx(0.25 / 40**0.5)
    why = "max |difference| 0.25; on this device they must be equal"
    assert decode_path.agrees(near, ref, exact=True) == (False, why)
    assert decode_path.agrees(near, ref, exact=False) == (
        True,
        "max |difference| 0.25, relative error 0.0395 (rounding allows 0.0469)",
    )
    assert decode_path.agrees(far, ref, exact=False)[0] is False
    # the same difference in float32 logits is far past rounding
    assert decode_path.agrees(near.float(), ref.float(), exact=False)[0] is False


def _rotary_rounded_once(q, k, cos, sin):
    """The rotary embedding with its products and sum in float32, rounded once at the end: one
    rounding apart from the family's ops, which round each product (as a GPU's fused kernel can be)."""

    def rotate(x):
        x32, half = x.float(), x.shape[-1] // 2
        turned = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * cos.float()[:, None] + turned * sin.float()[:, None]).to(x.dtype)

    return rotate(q), rotate(k)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_a_gpu_one_rounding_apart_keeps_it_and_a_wrong_step_does_not(family, monkeypatch):
    """Under the GPU's rule (within rounding), a decode path one rounding apart from transformers in
    bf16 is kept, though its largest logit moved by more than 1% (the rule before this one turned
    it off); one whose rotary positions are one off is turned off, and the tokens are then
    transformers'. Under the CPU's rule, the rounding is enough to turn it off."""
    monkeypatch.setattr(fused_kernels, "rotary", _rotary_rounded_once)
    seen = []
    agree = decode_path.agrees

    def spy(fast, ref, exact):
        seen.append((fast, ref))
        return agree(fast, ref, exact)

    monkeypatch.setattr(decode_path, "agrees", spy)

    shift = [0]  # added to the positions the decode path's rotary embedding reads
    real = DecodePath.__call__

    def shifted(self, plan):
        return real(self, dataclasses.replace(plan, positions=plan.positions + shift[0]))

    monkeypatch.setattr(DecodePath, "__call__", shifted)

    def run(exact: bool, by: int) -> tuple[LLMEngine, list]:
        on, _ = engines(family, "bfloat16")
        on.runner.decode_path.fused_rope, on.runner.decode_path.native_rope = by == 0, False
        on.runner.exact_decode_check = exact
        shift[0] = by
        return on, on.generate_batch(PROMPTS, sampled(6))

    rounded, _ = run(exact=False, by=0)
    fast, ref = seen.pop()
    assert not torch.equal(fast, ref)
    assert (fast.float() - ref.float()).abs().max() > 0.01 * ref.float().abs().max()
    assert 0 < decode_path.relative_error(fast, ref) <= decode_path.rounding_tolerance(torch.bfloat16)
    assert rounded.runner.decode_path is not None and rounded.runner.decode_path_checked
    assert run(exact=True, by=0)[0].runner.decode_path is None
    seen.clear()
    wrong, got = run(exact=False, by=1)
    fast, ref = seen.pop()
    assert decode_path.relative_error(fast, ref) > 4 * decode_path.rounding_tolerance(torch.bfloat16)
    assert wrong.runner.decode_path is None
    _, off = engines(family, "bfloat16")
    want = off.generate_batch(PROMPTS, sampled(6))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.log_probs for o in got] == [o.log_probs for o in want]
