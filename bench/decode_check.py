"""How far the engine's decode path is from transformers' forward at its first decode step, and what
the check there (`tidal.engine.decode_path.agrees`) makes of it, for rounding and for faults.

    python -m bench decode_check                        # real SmolLM2, bf16, 1 / 8 / 64 rows, CPU
    python -m bench decode_check --device cuda          # the same on a GPU ("as built" is the GPU's own gap)
    python -m bench decode_check --model tiny-qwen3     # a tiny random model of a family (tests/families.py)

The engine's first pure decode step runs both the decode path and transformers' forward over the
same cache and keeps the path only where they agree. For each case the step's logits of both are
compared over the batch: whether they are the same bits, the largest difference over the largest
logit (the rule before: ≤ 1%), and the relative error ‖fast − ref‖ / ‖ref‖ (the GPU's rule: ≤
6·eps of the dtype). Cases:

- `as built`: the engine as it is (on a CPU the same bits; on a GPU what its kernels give);
- `rotary rounded once`: the rotary embedding's products and sum in float32, rounded once (one
  rounding apart from the family's ops, as a fused GPU kernel may compute it): rounding, which the
  check should let pass;
- `positions + 1`: the rotary embedding one position ahead; `context one short`: attention that
  misses the token itself. Faults, which the check must catch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

from bench.common import machine, write_result
from bench.gpu import result_kind

CASES = ("as built", "rotary rounded once", "positions + 1", "context one short")


def _rotary_rounded_once(q, k, cos, sin):
    import torch

    def rotate(x):
        x32, half = x.float(), x.shape[-1] // 2
        turned = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * cos.float()[:, None] + turned * sin.float()[:, None]).to(x.dtype)

    return rotate(q), rotate(k)


@contextlib.contextmanager
def _case(case: str, seen: list):
    """Patch the decode path for `case`, and record the logits the first-step check compares."""
    from tidal.engine import decode_path, fused_kernels

    real_call, real_agrees, real_rotary = decode_path.DecodePath.__call__, decode_path.agrees, fused_kernels.rotary

    def call(self, plan):
        if case == "rotary rounded once":
            self.fused_rope, self.native_rope = True, False
        elif case == "positions + 1":
            plan = dataclasses.replace(plan, positions=plan.positions + 1)
        elif case == "context one short":
            plan = dataclasses.replace(plan, single_len=plan.single_len - 1)
        return real_call(self, plan)

    def agrees(fast, ref, exact):
        seen.append((fast.float().clone(), ref.float().clone(), ref.dtype))
        return real_agrees(fast, ref, exact)

    decode_path.DecodePath.__call__, decode_path.agrees = call, agrees
    fused_kernels.rotary = _rotary_rounded_once
    try:
        yield
    finally:
        decode_path.DecodePath.__call__, decode_path.agrees = real_call, real_agrees
        fused_kernels.rotary = real_rotary


def _model(name: str):
    """(model folder, tokenizer or None, prompts as token ids)."""
    if name == "smollm2":
        from tidal.convert import ensure_model, load_tokenizer

        path = ensure_model("smollm2")
        tok = load_tokenizer(path)
        questions = [f"What is {7 * i % 97} + {13 * i % 89}? Answer with the number." for i in range(64)]
        ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
        return path, tok, [i if isinstance(i, list) else i["input_ids"] for i in ids]
    if not name.startswith("tiny-"):
        sys.exit(f"--model: smollm2 or tiny-<family>, got {name!r}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from families import tiny_model

    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(3 + i % 17)] for i in range(64)]
    return tiny_model(name[len("tiny-") :]), None, prompts


def measure(model: str, dtype: str, device: str, row_counts: list[int]) -> list[dict]:
    """One row per (row count, case): the first-step check's inputs compared both ways."""
    import torch

    from tidal.contracts import SamplingParams
    from tidal.engine.decode_path import relative_error, rounding_tolerance
    from tidal.engine.llm_engine import LLMEngine

    path, tok, prompts = _model(model)
    rows = []
    for n in row_counts:
        for case in CASES:
            seen: list = []
            with _case(case, seen):
                engine = LLMEngine(path, tok, dtype=dtype, device=device, kv_cache_tokens=16384)
                engine.runner.exact_decode_check = False  # the GPU's rule, on any device
                params = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=i, ignore_eos=True) for i in range(n)]
                engine.generate_batch(prompts[:n], params)
            fast, ref, logits_dtype = seen[0]
            err = relative_error(fast, ref)
            row = {
                "rows": n,
                "case": case,
                "same_bits": bool(torch.equal(fast, ref)),
                "max_diff_over_max_logit": float((fast - ref).abs().max() / ref.abs().max()),
                "relative_error": err,
                "tolerance": rounding_tolerance(logits_dtype),
            }
            row["passes_1pct_rule"] = row["max_diff_over_max_logit"] <= 0.01
            row["passes"] = row["same_bits"] or err <= row["tolerance"]
            rows.append(row)
            print(
                f"{n:4d} rows  {case:20s}  same bits {str(row['same_bits']):5s}  max|d|/max|z| "
                f"{row['max_diff_over_max_logit']:.4f} ({'pass' if row['passes_1pct_rule'] else 'FAIL'} at 1%)  "
                f"relative error {err:.4f} ({'pass' if row['passes'] else 'FAIL'} at {row['tolerance']:.4f})",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench decode_check")
    p.add_argument("--model", default="smollm2", help="smollm2, or tiny-<family> (llama, qwen3, ...)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default="1,8,64")
    args = p.parse_args()
    rows = measure(args.model, args.dtype, args.device, [int(x) for x in args.rows.split(",")])
    settings = {"model": args.model, "dtype": args.dtype, "device": args.device}
    payload = {"machine": machine(), "settings": settings, "rows": rows}
    out = write_result(f"decode_check-{args.model}-{args.dtype}", payload, kind=result_kind(args.device, smoke=False))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
