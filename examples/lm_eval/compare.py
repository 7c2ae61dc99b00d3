"""Check that lm-eval's greedy answers through tidal's OpenAI route are /generate's greedy answers.

    python examples/lm_eval/compare.py SAMPLES.jsonl http://127.0.0.1:30123

For every sample lm-eval logged (`--log_samples`), the same prompt text goes to `/generate` at
temperature 0 with the task's `until` strings and `max_gen_toks`; the two texts must be equal.
"""

from __future__ import annotations

import json
import sys

import httpx


def main(samples_path: str, url: str) -> int:
    equal = total = 0
    for line in open(samples_path):
        sample = json.loads(line)
        prompt, gen = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
        params = {"temperature": 0, "max_new_tokens": gen["max_gen_toks"], "stop": gen["until"]}
        ours = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": params}, timeout=60).json()
        theirs = sample["resps"][0][0]
        total += 1
        equal += ours["text"] == theirs
        if ours["text"] != theirs:
            print(f"doc {sample['doc_id']}: lm-eval {theirs!r} != /generate {ours['text']!r}")
    print(f"{equal}/{total} greedy answers equal")
    return 0 if equal == total else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
