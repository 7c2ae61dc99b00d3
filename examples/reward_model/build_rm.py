"""Build the example's reward model: sample SmolLM2-135M-Instruct's own answers to the prompts of
`rm_prompts.jsonl` with tidal's engine, pair an answer that states a number (chosen) with one of
the same prompt that does not (rejected), and train a sequence-classification head on SmolLM2
(`AutoModelForSequenceClassification`, one label) with the Bradley-Terry loss

    loss = -log sigmoid(r(prompt, chosen) - r(prompt, rejected))

Only the last `--layers` transformer blocks, the final norm and the new score head train (the
rest stays SmolLM2's), so it runs in minutes on a 2-core CPU. The folder it writes is what
`reward.fn: rm` loads (`rm.path`). The held-out pairwise accuracy is measured through tidal's own
`RewardModel`, the code that scores the GRPO run, so the text it reads is the text it trained on.

    python examples/reward_model/build_rm.py --out runs/reward_model/rm
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from preference import states_a_number
from transformers import AutoModelForSequenceClassification

from tidal.contracts import SamplingParams
from tidal.convert import ensure_model, load_tokenizer
from tidal.data.load import load_data
from tidal.data.options import DataConfig
from tidal.engine.llm_engine import LLMEngine
from tidal.reward.options import RewardModelConfig
from tidal.reward.reward_model import MESSAGES_KEY, RewardModel
from tidal.types import Sample

HERE = Path(__file__).parent


def sample_answers(model_dir: Path, tokenizer, records, n: int, max_new_tokens: int, seed: int) -> list[list[str]]:
    """`n` answers per prompt from the policy's starting weights, sampled as the GRPO run samples
    (temperature 1, the same token budget)."""
    engine = LLMEngine(model_dir, tokenizer, dtype="float32", kv_cache_tokens=16384)
    prompts = [r.input_ids for r in records for _ in range(n)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed + i) for i in range(len(prompts))
    ]
    outs = engine.generate_batch(prompts, params)
    texts = [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    return [texts[i * n : (i + 1) * n] for i in range(len(records))]


def make_pairs(records, answers, per_prompt: int, rng: random.Random) -> list[tuple[list[dict], str, str]]:
    """(messages, chosen, rejected): up to `per_prompt` pairs per prompt, chosen stating a number."""
    pairs = []
    for rec, texts in zip(records, answers, strict=True):
        good = [t for t in texts if states_a_number(t)]
        bad = [t for t in texts if not states_a_number(t)]
        combos = [(g, b) for g in good for b in bad]
        rng.shuffle(combos)
        pairs += [(rec.messages, g, b) for g, b in combos[:per_prompt]]
    return pairs


def encode(tokenizer, messages: list[dict], answer: str) -> list[int]:
    """The ids `RewardModel` scores: the conversation in the model's chat template, the answer as
    the assistant turn (`tidal.reward.reward_model.RewardModel.text_of`)."""
    text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}], tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def scores(model, batch: list[list[int]], pad: int) -> torch.Tensor:
    """The scalar reward of each id list, padded on the right (the head reads the last real token)."""
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def train(model, tokenizer, pairs, epochs: int, batch_size: int, lr: float, rng: random.Random) -> list[float]:
    """Bradley-Terry training on `pairs`; the mean loss of each epoch."""
    pad = model.config.pad_token_id
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    data = [(encode(tokenizer, m, c), encode(tokenizer, m, r)) for m, c, r in pairs]
    losses = []
    model.train()
    for _ in range(epochs):
        rng.shuffle(data)
        total = 0.0
        for start in range(0, len(data), batch_size):
            chunk = data[start : start + batch_size]
            r = scores(model, [c for c, _ in chunk] + [x for _, x in chunk], pad)
            loss = -F.logsigmoid(r[: len(chunk)] - r[len(chunk) :]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(chunk)
        losses.append(total / len(data))
    model.eval()
    return losses


def pair_accuracy(rm_dir: Path, pairs) -> float:
    """How often tidal's `RewardModel` scores the chosen answer above the rejected one."""
    rm = RewardModel(RewardModelConfig(path=str(rm_dir), device="cpu", dtype="float32"))

    def sample(messages, answer):
        return Sample(prompt="", response=answer, metadata={MESSAGES_KEY: messages})

    chosen = rm.score([sample(m, c) for m, c, _ in pairs])
    rejected = rm.score([sample(m, r) for m, _, r in pairs])
    return sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/reward_model/rm", help="folder the reward model is saved to")
    ap.add_argument("--prompts", default=str(HERE / "rm_prompts.jsonl"))
    ap.add_argument("--n", type=int, default=6, help="answers sampled per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--pairs-per-prompt", type=int, default=4)
    ap.add_argument("--heldout", type=float, default=0.2, help="share of the prompts whose pairs are held out")
    ap.add_argument("--layers", type=int, default=2, help="last transformer blocks trained with the head")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model_dir = ensure_model("smollm2")
    tokenizer = load_tokenizer(model_dir)

    t0 = time.perf_counter()
    records = load_data(DataConfig(path=args.prompts, max_prompt_length=256), tokenizer)
    answers = sample_answers(model_dir, tokenizer, records, args.n, args.max_new_tokens, args.seed)
    with_number = sum(states_a_number(t) for texts in answers for t in texts) / (len(records) * args.n)
    order = list(range(len(records)))
    rng.shuffle(order)
    cut = int(len(order) * (1 - args.heldout))

    def pairs_of(indices: list[int]) -> list[tuple[list[dict], str, str]]:
        return make_pairs([records[i] for i in indices], [answers[i] for i in indices], args.pairs_per_prompt, rng)

    train_pairs, test_pairs = pairs_of(order[:cut]), pairs_of(order[cut:])  # held out by prompt
    t_sample = time.perf_counter() - t0

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.requires_grad_(False)
    for block in model.model.layers[-args.layers :]:
        block.requires_grad_(True)
    model.model.norm.requires_grad_(True)
    model.score.requires_grad_(True)
    t1 = time.perf_counter()
    losses = train(model, tokenizer, train_pairs, args.epochs, args.batch_size, args.lr, rng)
    t_train = time.perf_counter() - t1

    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "prompts": len(records),
        "answers_with_a_number": round(with_number, 3),
        "train_pairs": len(train_pairs),
        "heldout_pairs": len(test_pairs),
        "loss_by_epoch": [round(x, 4) for x in losses],
        "train_pair_accuracy": round(pair_accuracy(out, train_pairs), 3),
        "heldout_pair_accuracy": round(pair_accuracy(out, test_pairs), 3),
        "sampling_s": round(t_sample, 1),
        "training_s": round(t_train, 1),
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
