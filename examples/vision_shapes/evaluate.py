"""Greedy accuracy of a model folder on the held-out pictures, and the same questions with each
picture swapped for another prompt's (a control: a policy that reads the picture falls to chance
there, one that learned the answers' distribution does not).

    python examples/vision_shapes/evaluate.py MODEL [DATA]    # DATA: work/shapes-2.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from colour import WORDS  # noqa: E402


def accuracy(model: Path, data: Path) -> dict:
    from tidal.contracts import SamplingParams
    from tidal.convert import load_tokenizer
    from tidal.data.dataset import load_prompts
    from tidal.data.images import ImageReader
    from tidal.engine.llm_engine import LLMEngine

    tok = load_tokenizer(model)
    records, _ = load_prompts(data, tok, images=ImageReader.for_model(model, data.parent))
    engine = LLMEngine(model, tok, dtype="float32", kv_cache_tokens=16384)
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=16) for _ in records]
    shifted = [records[(i + 1) % len(records)].images for i in range(len(records))]
    out = {}
    for name, images in (("pictures", [r.images for r in records]), ("swapped pictures", shifted)):
        answers = engine.generate_batch([r.input_ids for r in records], greedy, images)
        found = [WORDS.search(a.text.lower()) for a in answers]
        right = sum(f is not None and f.group(1) == r.label for f, r in zip(found, records, strict=True))
        out[name] = right / len(records)
    out["prompts"] = len(records)
    return out


if __name__ == "__main__":
    model = Path(sys.argv[1])
    data = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "work" / "shapes-2.jsonl"
    print(json.dumps({"model": str(model), **accuracy(model, data)}))
