"""What every benchmark records next to its numbers: the machine, the versions, the settings."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import torch
    import transformers

    from tidal.hardware import cpu_info

    # the CPU model, the capability torch dispatches to and whether bf16 is native: figures from
    # an AVX2-only CPU and from one with AVX512-BF16 are not comparable
    return {
        **cpu_info(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_kind() -> str:
    """The kind of CPU a result belongs to, in its file name: `avx2`, `avx512-bf16`, ...; with
    `-emulated` where torch was restricted to a capability (`ATEN_CPU_CAPABILITY`), so a run that
    emulates a kind does not replace one measured on it."""
    from tidal.hardware import cpu_info

    info = cpu_info()
    kind = str(info["cpu_capability"]).lower() + ("-bf16" if info["bf16_native"] else "")
    return kind + ("-emulated" if os.environ.get("ATEN_CPU_CAPABILITY") else "")


def write_result(name: str, payload: dict, kind: str | None = None) -> Path:
    """`bench/results/<name>-<machine kind>.json`, written atomically: each kind of CPU keeps its own
    (`kind` names another machine, such as a GPU, in its place)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{kind or machine_kind()}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
    return path


def run_measurement(cmd: list[str], what: str, env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """Run one measurement `cmd` in a fresh process (with `env`, default this one's) and return the
    JSON of its `RESULT {json}` stdout line, with `process_seconds` (its wall time) added; exit
    naming `what` and showing the end of its stderr when it prints none, or when it runs past
    `timeout` seconds (None: no limit)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        sys.exit(f"{what} ran past its {timeout:.0f} s limit and was stopped:\n{err[-4000:]}")
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{what} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    res = json.loads(line[len("RESULT ") :])
    res["process_seconds"] = time.perf_counter() - t0
    return res


# SmolLM2-135M-Instruct's shape (a Llama): random weights of it stand in where the bundled GGUF is
# not needed (`bench decode`) or not there (`bench gpu`'s `smollm2-random`)
SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
