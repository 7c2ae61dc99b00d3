"""VLLMCore on the real SmolLM2-135M-Instruct in fp32: the log-probs a rollout records at step 0
agree with the trainer's (a transformers fp32 forward over the same tokens), so the first policy
update starts with no rollout/trainer mismatch. A module of its own: one vLLM engine per process
(test_vllm.py's is closed when its module ends)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tidal.contracts import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (scripts/setup_vllm.sh builds .venv-vllm with it)",
    ),
]

QUESTIONS = [
    "What is 2 + 3?",
    "Name a colour.",
    "Write the word cat backwards, then explain briefly.",
    "What is 17 * 4? Think step by step.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.adapters.vllm_core import VLLMCore

    path = smollm2_dir
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for q in QUESTIONS
    ]
    core = VLLMCore(path, tok, dtype="float32", kv_cache_tokens=4096)
    yield core, model, prompts
    core.close()


def generate(core, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(str(i), p, sp)
    done = {}
    while core.has_unfinished():
        for o in core.step():
            done[o.request_id] = o
    return [done[str(i)] for i in range(len(prompts))]


def trainer_log_probs(model, prompt, tokens, temperature=1.0, top_p=1.0) -> tuple[list[float], list[bool]]:
    """Each token's log-prob under softmax(logits / T) kept to the smallest most-likely set
    reaching top_p and renormalised (tidal.engine.sampling's definition), from an fp32 forward;
    and per token whether the top-p cut is a knife edge (some token's mass above it is within
    1e-5 of top_p, where fp32 rounding in either implementation decides whether it is kept)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float() / temperature
    edge = [False] * len(tokens)
    if top_p < 1:
        sorted_z, order = logits.sort(dim=-1, descending=True, stable=True)
        probs = sorted_z.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        edge = ((before - top_p).abs() < 1e-5).any(-1).tolist()
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), -math.inf)
    logp = torch.log_softmax(logits, -1)
    return [logp[j, t].item() for j, t in enumerate(tokens)], edge


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_step0_log_probs_match_a_transformers_fp32_forward(smollm2, temperature, top_p):
    core, model, prompts = smollm2
    batch = [p for p in prompts for _ in range(4)]  # 4 samples per prompt, as a GRPO group
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=48, seed=1000 + i)
        for i in range(len(batch))
    ]
    outs = generate(core, batch, params)
    gaps, edges = [], 0
    for p, o in zip(batch, outs, strict=True):
        expect, edge = trainer_log_probs(model, p, o.token_ids, temperature, top_p)
        # at a knife-edge top-p cut vLLM (ascending fp32 cumsum) and tidal (descending) may keep
        # one more or one fewer token: both log-probs are right for their own kept set
        gaps += [abs(a - b) for a, b, e in zip(o.log_probs, expect, edge, strict=True) if not e]
        edges += sum(edge)
    assert len(gaps) >= 200  # enough sampled tokens to mean something
    assert edges <= len(gaps) // 50
    assert max(gaps) <= 1e-4


def test_greedy_is_token_exact_with_transformers(smollm2):
    core, model, prompts = smollm2
    outs = generate(core, prompts, [SamplingParams(temperature=0.0, max_new_tokens=16) for _ in prompts])
    for p, o in zip(prompts, outs, strict=True):
        ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16, pad_token_id=2)[0, len(p) :]
        assert o.token_ids == ref.tolist()[: len(o.token_ids)]


def test_after_a_weight_update_log_probs_match_the_updated_model(smollm2):
    """An RL step's update (every parameter moved a little) reaches every layer, including the
    output projection SmolLM2 ties to its embedding."""
    import copy

    core, model, prompts = smollm2
    g = torch.Generator().manual_seed(0)
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    core.update_weights_from_tensors([(n, p.detach()) for n, p in updated.named_parameters()], version=1)
    try:
        params = [SamplingParams(temperature=1.0, max_new_tokens=32, seed=7 + i) for i in range(len(prompts))]
        gaps = []
        for p, o in zip(prompts, generate(core, prompts, params), strict=True):
            assert o.weight_version == 1
            expect, _ = trainer_log_probs(updated, p, o.token_ids)
            gaps += [abs(a - b) for a, b in zip(o.log_probs, expect, strict=True)]
        assert max(gaps) <= 1e-4
    finally:
        core.update_weights_from_tensors([(n, p.detach()) for n, p in model.named_parameters()], version=0)
