"""The GPU's one-launch draw (`tidal.engine.sample_kernel`), run by Triton's interpreter on the
CPU: the torch path's tokens and log-probs, a row's token whatever shares its launch, tokens of
zero weight never drawn, and the frequencies of many seeded draws (a χ² test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

CHECK = """
import json, sys
from tests.engine.test_sample_kernel import compare
print(json.dumps(compare(sys.argv[1])))
"""

# group masses of the χ² test's distribution: 6 groups of 100 tokens over 600 (three chunks)
GROUPS = [0.3, 0.25, 0.2, 0.12, 0.08, 0.05]
DRAWS = 300


def compare(device: str) -> dict:
    import math

    from tidal.engine import sample_kernel, sampling

    out: dict = {"self_check": sampling.kernel_check(torch.device(device))}
    gen = torch.Generator().manual_seed(1)
    for name in ("float32", "bfloat16"):
        # 1,003 and 5,000 tokens: not whole chunks; temperatures 0.5-1.5; a third of the rows
        # unseeded (their uniforms given), the others seeded with draw indices
        for v in (1003, 5000):
            b = 24
            logits = (torch.randn(b, v, generator=gen) * 2).to(getattr(torch, name)).to(device)
            temp = torch.linspace(0.5, 1.5, b).to(device)
            seeds = (torch.arange(b) * 11 + 7).to(device)
            seeded = (torch.arange(b) % 3 != 0).to(device)
            draws = (torch.arange(b) * 3).to(device)
            u = torch.rand(b, generator=gen).to(device)
            tok, lp = sample_kernel.draw(logits, temp, u, seeds, seeded, draws)
            want_u = torch.where(seeded, sampling.row_uniforms(seeds, draws), u)
            probs = torch.softmax(logits.float() / temp[:, None], dim=-1)
            want = sampling._inverse_cdf(probs, want_u)
            exact = torch.log_softmax(logits.double() / temp[:, None].double(), dim=-1).gather(1, tok[:, None])[:, 0]
            # rows 5 and 17 alone: the same token and log-prob as beside the others
            alone = [sample_kernel.draw(logits[i : i + 1], temp[i : i + 1], u[i : i + 1], seeds[i : i + 1],
                                        seeded[i : i + 1], draws[i : i + 1]) for i in (5, 17)]  # fmt: skip
            out[f"{name}-{v}"] = {
                "tokens_equal": torch.equal(tok, want),
                "lp_vs_torch": float((lp - torch.log(probs.gather(1, want[:, None])[:, 0])).abs().max()),
                "lp_vs_exact": float((lp.double() - exact).abs().max()),
                "alone_equal": all(
                    torch.equal(t, tok[i : i + 1]) and torch.equal(p, lp[i : i + 1])
                    for (t, p), i in zip(alone, (5, 17), strict=True)
                ),
            }
    # zero weight: -inf logits are never drawn, at the uniforms' ends too
    z = torch.full((3, 600), -math.inf)
    z[:, [7, 300, 401]] = torch.tensor([0.5, 1.0, 2.0])
    tok, lp = sample_kernel.draw(z.to(device), torch.ones(3, device=device),
                                 torch.tensor([0.0, 0.999999, 1.0 - 2**-24], device=device), None, None,
                                 torch.zeros(3, dtype=torch.long, device=device))  # fmt: skip
    out["zero_weight_tokens"] = tok.tolist()
    # frequencies: DRAWS seeded rows of one distribution whose six groups of 100 tokens hold GROUPS
    inner = torch.randn(600, generator=gen)
    z = torch.cat([torch.log_softmax(inner[i * 100 : (i + 1) * 100], 0) + math.log(m) for i, m in enumerate(GROUPS)])
    n = DRAWS
    tok, _ = sample_kernel.draw(z.expand(n, -1).contiguous().to(device), torch.ones(n, device=device),
                                torch.zeros(n, device=device), torch.arange(n, device=device) + 1000, None,
                                torch.zeros(n, dtype=torch.long, device=device))  # fmt: skip
    out["group_counts"] = torch.bincount(tok.cpu() // 100, minlength=6).tolist()
    return out


def _check(result: dict) -> None:
    assert result["self_check"] is None, result["self_check"]
    for key, r in result.items():
        if key in ("self_check", "zero_weight_tokens", "group_counts"):
            continue
        assert r["tokens_equal"] and r["alone_equal"], (key, r)
        assert r["lp_vs_torch"] < 2e-6 and r["lp_vs_exact"] < 1e-5, (key, r)
    assert result["zero_weight_tokens"] == [7, 401, 401]
    counts = result["group_counts"]
    chi2 = sum((c - DRAWS * m) ** 2 / (DRAWS * m) for c, m in zip(counts, GROUPS, strict=True))
    assert sum(counts) == DRAWS and chi2 < 20.5, (counts, chi2)  # 5 degrees of freedom, p = 0.001


def test_the_kernel_draws_the_torch_paths_tokens_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", CHECK, "cpu"], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    _check(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_draws_the_torch_paths_tokens_on_cuda():
    _check(compare("cuda"))
