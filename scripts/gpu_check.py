"""What a user with a GPU runs first (`bash scripts/gpu_check.sh`): the environment, then the
quickstart on `cluster.device cuda` for 5 steps, then a 2-rank NCCL FSDP2 step when 2 GPUs are
present. Each check prints PASS, FAIL or SKIP with its figures; the JSON goes to
`runs/gpu_check/gpu_check.json`. `--device cpu` rehearses the same checks on a CPU (gloo)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict:
    import torch

    from tidal.hardware import cpu_info

    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    env["cpu"] = cpu_info()
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpu_memory_gib"] = {"free": round(free / 2**30, 1), "total": round(total / 2**30, 1)}
        env["bf16"] = torch.cuda.is_bf16_supported()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # a build without NCCL
            env["nccl"] = f"unavailable ({e})"
    return env


def train(out: Path, device: str, steps: int, extra: list[str]) -> dict:
    """`tidal train` on the quickstart config; the run's last metrics row and its wall time."""
    cmd = [sys.executable, "-m", "tidal.cli", "train", "--config", "examples/quickstart/config.yaml"]
    cmd += ["--cluster.device", device, "--train.num_steps", str(steps), "--train.output_dir", str(out)]
    cmd += ["--train.save_interval", "0", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = (
        [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if proc.returncode == 0 else []
    )
    if proc.returncode != 0 or len(rows) < steps:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"ok": False, "wall_s": round(wall, 1), "error": " | ".join(tail)}
    keep = ("time/step", "time/rollout", "time/train", "reward/mean", "memory/max_allocated_gib")
    last = {k: round(v, 4) for k, v in rows[-1].items() if k in keep}
    config = json.loads((out / "config.json").read_text())
    resolved = config.get("resolved", {}).get("cluster.device", {})
    return {"ok": True, "wall_s": round(wall, 1), "steps": len(rows), "device": resolved, "last": last}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: rehearse on a CPU")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    root = ROOT / "runs" / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    env = environment()
    print(json.dumps(env, indent=2))
    report: dict = {"environment": env, "checks": {}}
    gpus = len(env.get("gpus", []))
    on_gpu = args.device == "cuda"

    def record(name: str, result: dict | None, why: str = "") -> None:
        status = "SKIP" if result is None else ("PASS" if result["ok"] else "FAIL")
        report["checks"][name] = {"status": status, **(result or {"why": why})}
        print(f"{status}  {name}: {json.dumps(result) if result else why}", flush=True)

    if on_gpu and gpus == 0:
        record("quickstart", None, "torch sees no CUDA device")
    else:
        record("quickstart", train(root / "quickstart", args.device, args.steps, []))
    if on_gpu and gpus < 2:
        record("fsdp2_2_ranks", None, f"needs 2 GPUs, torch sees {gpus}")
    else:
        gpu_args = ["--cluster.gpus_per_trainer", "1", "--cluster.gpus_per_engine", "1"] if on_gpu else []
        ranks = ["--cluster.trainers", "2", "--cluster.engines", "1", *gpu_args]
        record("fsdp2_2_ranks", train(root / "fsdp2", args.device, 1, ranks))
    (root / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"report: {root / 'gpu_check.json'}")
    return 0 if all(c["status"] != "FAIL" for c in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
