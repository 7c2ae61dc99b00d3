import pytest
import torch
from conftest import hf_greedy
from conftest import make_model as _make_model

from tidal.adapters.hf_engine import HFEngine
from tidal.contracts import SamplingParams
from tidal.engine.weights import WeightsError

PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 17], [1, 44, 45, 46, 47, 48, 49, 50, 51], [1, 7]]


def make_model(seed=0, **kw):
    # untied embeddings: a random tied model's greedy choice is just its input token again
    return _make_model(seed=seed, tie_word_embeddings=False, **kw)


def greedy(n=12, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def test_greedy_matches_transformers_generate_and_forward_log_probs(tokenizer):
    model = make_model()
    engine = HFEngine(make_model(), tokenizer, dtype="float32")
    outs = engine.generate_batch(PROMPTS, [greedy() for _ in PROMPTS])
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == hf_greedy(model, p, 12)
        # the log-probs equal a plain forward pass over prompt + response
        full = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0].float(), -1)
        ref = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(o.token_ids)]
        assert o.log_probs == pytest.approx(ref, abs=1e-4)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length")


def test_sampled_log_probs_use_the_tempered_distribution(tokenizer):
    model = make_model()
    engine = HFEngine(make_model(), tokenizer, dtype="float32")
    sp = SamplingParams(temperature=0.7, max_new_tokens=8, seed=3)
    (o,) = engine.generate_batch([PROMPTS[0]], [sp])
    full = torch.tensor([PROMPTS[0] + o.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0].float() / 0.7, -1)
    ref = [logp[len(PROMPTS[0]) - 1 + j, t].item() for j, t in enumerate(o.token_ids)]
    assert o.log_probs == pytest.approx(ref, abs=1e-4)


def test_seed_gives_same_tokens_whatever_the_batch(tokenizer):
    engine = HFEngine(make_model(), tokenizer, dtype="float32")
    sp = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed)  # noqa: E731
    alone = engine.generate_batch([PROMPTS[1]], [sp(11)])[0]
    mixed = engine.generate_batch(PROMPTS, [sp(5), sp(11), sp(6), sp(7)])[1]
    assert alone.token_ids == mixed.token_ids
    assert alone.log_probs == pytest.approx(mixed.log_probs, abs=1e-5)
    other = engine.generate_batch([PROMPTS[1]], [sp(12)])[0]
    assert other.token_ids != alone.token_ids


def test_group_shares_one_prefill_and_matches_separate_runs(tokenizer):
    engine = HFEngine(make_model(), tokenizer, dtype="float32")
    sp = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed)  # noqa: E731
    before = engine.counters["prefill_tokens"]
    group = engine.generate_batch([PROMPTS[0]] * 4, [sp(s) for s in range(4)])
    assert engine.counters["prefill_tokens"] - before == len(PROMPTS[0])  # prefilled once, not 4 times
    for s in range(4):
        assert engine.generate_batch([PROMPTS[0]], [sp(s)])[0].token_ids == group[s].token_ids


def test_stop_string_and_max_tokens(tokenizer):
    engine = HFEngine(make_model(), tokenizer, dtype="float32")
    free = engine.generate_batch([PROMPTS[2]], [greedy(20, stop_token_ids=[])])[0]
    text = tokenizer.decode(free.token_ids[:5], skip_special_tokens=True)
    stop = text[-2:]
    assert stop.strip(), "need a visible stop string"
    cut = engine.generate_batch([PROMPTS[2]], [greedy(20, stop=[stop])])[0]
    assert cut.finish_reason == "stop"
    assert stop in cut.text and len(cut.token_ids) <= 5
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    short = engine.generate_batch(
        [PROMPTS[2]], [SamplingParams(temperature=1.0, max_new_tokens=3, seed=0, stop_token_ids=[])]
    )[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_update_weights_changes_outputs_and_version(tokenizer, tmp_path):
    engine = HFEngine(make_model(seed=0), tokenizer, dtype="float32")
    other = make_model(seed=1)
    before = engine.generate_batch(PROMPTS, [greedy() for _ in PROMPTS])
    engine.update_weights_from_tensors(other.named_parameters(), version=3)
    assert engine.weight_version == 3
    after = engine.generate_batch(PROMPTS, [greedy() for _ in PROMPTS])
    assert [o.weight_version for o in after] == [3] * 4
    assert [o.token_ids for o in after] == [hf_greedy(other, p, 12) for p in PROMPTS]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    # from disk: back to the first model's weights
    make_model(seed=0).save_pretrained(tmp_path)
    engine.update_weights_from_disk(tmp_path, version=4)
    assert [o.token_ids for o in engine.generate_batch(PROMPTS, [greedy() for _ in PROMPTS])] == [
        o.token_ids for o in before
    ]
    with pytest.raises(WeightsError, match="no parameter .nope."):
        engine.update_weights_from_tensors([("nope", torch.zeros(1))], version=5)
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        engine.update_weights_from_disk(tmp_path / "empty", version=5)


def test_bad_requests_are_rejected(tokenizer):
    engine = HFEngine(make_model(max_position_embeddings=16), tokenizer, dtype="float32")
    with pytest.raises(
        ValueError, match="request 0: the prompt has 9 tokens \\+ max_new_tokens 12 > context length 16"
    ):
        engine.generate_batch([PROMPTS[2]], [greedy()])
    with pytest.raises(ValueError, match="request 0: the prompt is empty"):
        engine.generate_batch([[]], [greedy()])
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        engine.generate_batch(PROMPTS[:2], [greedy()])
