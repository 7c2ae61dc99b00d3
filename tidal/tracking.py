"""Experiment tracking beside metrics.jsonl and TensorBoard: Weights & Biases (`log.wandb: true`).

wandb is an optional extra (`pip install 'tidal[wandb]'`), imported only when asked for. The
default `log.wandb_mode: offline` writes the run under `RUN_DIR/wandb/` with no network; upload it
later with `wandb sync RUN_DIR/wandb/offline-run-*`. The run id is kept in `RUN_DIR/wandb_run_id`
so `--resume` continues the same wandb run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tidal.utils import atomic_write_text

__all__ = ["WandbTracker", "open_tracker"]

RUN_ID_FILE = "wandb_run_id"


class WandbTracker:
    """Sends each logged step to a wandb run. Non-finite values are left out, as in TensorBoard."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, step: int, values: dict[str, int | float]) -> None:
        self.run.log({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(log_cfg, run_dir: str | Path, run_config: dict, resume: bool = False) -> WandbTracker | None:
    """A wandb run for `log_cfg` (`LogConfig`), or None when `log.wandb` is off.

    Raises RuntimeError naming the fix when wandb is asked for but not installed."""
    if not log_cfg.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "log.wandb: true needs the wandb package: pip install 'tidal[wandb]' (or set log.wandb false)"
        ) from None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if resume and id_file.exists() else None
    run = wandb.init(
        project=log_cfg.wandb_project,
        mode=log_cfg.wandb_mode,
        dir=str(run_dir),
        id=run_id,
        resume="allow" if run_id else None,
        name=run_dir.name,
        config=run_config,
        # tidal prints its own step lines; wandb capturing the console would duplicate them
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )
    atomic_write_text(id_file, run.id + "\n")
    return WandbTracker(run)
