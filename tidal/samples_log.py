"""Every step's samples kept in the run folder, and a few shown on the console.

Each step is one gzip-compressed JSONL file, `RUN_DIR/samples/step_000012.jsonl.gz` (the step
number is the one in metrics.jsonl), written whole to a temporary file and renamed into place:
a run killed mid-write leaves the previous steps intact and no half file. One file per step also
makes a later step cheap to read without decompressing the ones before it.

A record holds what a person looks at (text, reward and its parts, status, lengths, weight version,
group, advantage, the sample's metadata), not the token ids; `debug.save_rollout` keeps whole
samples for replay.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.reward.score import scalar_reward
from tidal.types import Sample
from tidal.utils import atomic_write_bytes

__all__ = [
    "SAMPLES_DIR",
    "read_jsonl_gz",
    "read_samples",
    "record_step",
    "sample_records",
    "saved_steps",
    "step_path",
    "write_jsonl_gz",
]

SAMPLES_DIR = "samples"
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl\.gz$")
# Console lines stay readable in a CI log: one line per sample, the response cut to this length.
_SHOWN_CHARS = 160

log = logging.getLogger("tidal")


def step_path(directory: str | Path, step: int) -> Path:
    """`directory/step_000012.jsonl.gz` for step 12."""
    return Path(directory) / f"step_{step:06d}.jsonl.gz"


def write_jsonl_gz(path: str | Path, rows: Iterable[dict], strict: bool = False) -> None:
    """Write `rows` as gzip-compressed JSON lines, atomically (temporary file, fsync, rename).

    With `strict`, a value JSON cannot hold raises TypeError; otherwise it is written as its str()
    (a display record must not stop a run over one odd metadata value)."""
    text = "".join(json.dumps(r, ensure_ascii=False, default=None if strict else str) + "\n" for r in rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same rows give the same bytes, so re-running a step is byte-identical.
    atomic_write_bytes(path, gzip.compress(text.encode("utf-8"), compresslevel=6, mtime=0))


def read_jsonl_gz(path: str | Path) -> list[dict]:
    """The rows of a file written by `write_jsonl_gz`; a bad file or line raises ValueError naming it."""
    path = Path(path)
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a gzip-compressed JSONL file ({type(e).__name__}: {e})") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg}): {line[:80]!r}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def saved_steps(directory: str | Path) -> list[int]:
    """Step numbers of the `step_*.jsonl.gz` files in `directory`, ascending (none: [])."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _STEP_FILE.match(p.name)))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def sample_records(
    step: int,
    samples: Sequence[Sample],
    rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    reward_key: str = "score",
) -> list[dict[str, Any]]:
    """One display record per sample. `rewards` ([N], the trained-on scalar after shaping) and
    `advantages` ([N, R], per response token) are optional; a sample's advantage is the mean over
    its response tokens (for GRPO every token carries the same value)."""
    out = []
    for i, s in enumerate(samples):
        if rewards is not None:
            reward = float(rewards[i])
        else:
            try:
                reward = scalar_reward(s, reward_key)
            except (KeyError, ValueError):
                reward = math.nan
        adv = None
        if advantages is not None and s.response_length:
            adv = _finite(float(advantages[i, : s.response_length].float().mean()))
        out.append(
            {
                "step": step,
                "group": s.group_index,
                "index": s.index,
                "prompt": s.prompt,
                "response": s.response,
                "label": s.label,
                "reward": _finite(reward),
                "reward_parts": s.reward if isinstance(s.reward, dict) else None,
                "status": s.status.value,
                "prompt_length": s.prompt_length,
                "response_length": s.response_length,
                "weight_version": s.weight_version,
                "advantage": adv,
                "error": s.metadata.get("error"),
                # the data row's metadata and what the rollout added: an agent's calls
                # (agent_calls), a tool loop's turns and stop reason, the finish reason
                "metadata": dict(s.metadata),
            }
        )
    return out


def record_step(
    run_dir: str | Path,
    step: int,
    samples: Sequence[Sample],
    rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    *,
    reward_key: str = "score",
    show: int = 0,
    save: bool = True,
) -> Path | None:
    """Write step `step`'s samples to `run_dir/samples/` (when `save`) and log the first `show`
    of them, one line each. Returns the file written, if any."""
    records = sample_records(step, samples, rewards, advantages, reward_key)
    for r in records[:show]:
        reward = "-" if r["reward"] is None else f"{r['reward']:.2f}"
        adv = "" if r["advantage"] is None else f", adv {r['advantage']:+.2f}"
        log.info(
            "sample %d.%d (reward %s%s, %s, %d tokens, v%d): %r",
            step,
            r["index"],
            reward,
            adv,
            r["status"],
            r["response_length"],
            r["weight_version"],
            r["response"][:_SHOWN_CHARS],
        )
    if not save:
        return None
    path = step_path(Path(run_dir) / SAMPLES_DIR, step)
    write_jsonl_gz(path, records)
    return path


def read_samples(run_dir: str | Path, steps: Iterable[int] | None = None) -> dict[int, list[dict]]:
    """`{step: records}` from `run_dir/samples/`, for `steps` (default: every saved step)."""
    directory = Path(run_dir) / SAMPLES_DIR
    wanted = saved_steps(directory) if steps is None else list(steps)
    return {k: read_jsonl_gz(step_path(directory, k)) for k in wanted}
