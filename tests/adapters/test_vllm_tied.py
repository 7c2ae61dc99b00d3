"""VLLMCore on a tiny Llama whose output projection is tied to its input embedding (as SmolLM2's
is): weight updates and sleep/wake must reach the logits too. On CPU vLLM keeps a packed copy of
the tied projection that its reload does not refresh; `TidalWorkerExtension` repacks it. A module
of its own: one vLLM engine per process."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import hf_greedy, make_model, make_tokenizer

from tidal.contracts import SamplingParams

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (scripts/setup_vllm.sh builds .venv-vllm with it)",
    ),
]

PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 17], [7, 8, 9, 10]]


def tied(seed: int):
    return make_model(seed=seed, num_attention_heads=2, num_key_value_heads=1)  # tie_word_embeddings=True


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from tidal.adapters.vllm_core import VLLMCore

    path = tmp_path_factory.mktemp("vllm_tied")
    tied(0).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    core = VLLMCore(path, make_tokenizer(), dtype="float32", kv_cache_tokens=2048)
    yield core
    core.close()


def check_matches(core, model):
    """Greedy tokens equal transformers' and log-probs a forward of `model`, to 1e-4."""
    for i, p in enumerate(PROMPTS):
        core.add_request(f"q{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8))
    done = {}
    while core.has_unfinished():
        for o in core.step():
            done[o.request_id] = o
    for i, p in enumerate(PROMPTS):
        o = done[f"q{i}"]
        assert o.token_ids == hf_greedy(model, p, 8)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1], -1)
        assert o.log_probs == pytest.approx([logp[j, t].item() for j, t in enumerate(o.token_ids)], abs=1e-4)


def new_weights(seed: int) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]:
    model = tied(seed)
    # a tied model's named_parameters() names the shared tensor once: no lm_head.weight is sent
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert "lm_head.weight" not in dict(named)
    return model, named


def test_a_weight_update_reaches_the_tied_output_projection(core):
    check_matches(core, tied(0))
    model, named = new_weights(5)
    core.update_weights_from_tensors(named)
    check_matches(core, model)


def test_sleep_wake_and_update_on_a_tied_model(core):
    model, named = new_weights(7)
    core.sleep()
    core.wake()
    core.update_weights_from_tensors(named)
    check_matches(core, model)
