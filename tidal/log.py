"""Training metrics: a JSONL file (the source of truth), TensorBoard scalars, an optional tracker
(wandb, `tidal.tracking`) and a console line with throughput and ETA.

`metrics.jsonl` holds one JSON object per step, `{"step": k, **metrics}`, flushed as soon as the
step is logged so a killed run keeps every finished step. TensorBoard and the console are views
of the same numbers; losing either (no tensorboard install, no TTY) never stops training.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tidal.options import Need, opt

__all__ = [
    "LogConfig",
    "MetricsLogger",
    "print_reward_table",
    "quiet_libraries",
    "read_metrics",
    "reward_table",
    "setup_logging",
    "setup_worker_logging",
]


@dataclass
class LogConfig:
    dir: str | None = opt(None, "metrics folder (default: train.output_dir)")
    tensorboard: bool = opt(True, "write TensorBoard scalars")
    console: bool = opt(True, "print a line per step")
    log_samples: int = opt(2, "responses printed per step (0 = none)")
    save_samples: bool = opt(True, "keep every step's samples in output_dir/samples/step_N.jsonl.gz (tidal report)")
    wandb: bool = opt(False, "also log to Weights & Biases (pip install 'tidal[wandb]')")
    wandb_project: str = opt("tidal", "wandb project")
    wandb_mode: str = opt("offline", "wandb mode: offline (files under output_dir/wandb, no network) | online")

    def check(self, need: Need) -> None:
        need(self.wandb_mode in ("offline", "online"), f"log.wandb_mode: offline or online, got {self.wandb_mode!r}")


METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# Warn about a missing/broken tensorboard once per process, not once per logger or per step.
_tb_warned = False


def _parse_jsonl(text: str, path: Path) -> tuple[list[dict], bool]:
    """Parse metrics.jsonl text; return the rows and whether the last line was torn (the process
    died mid-write). A bad line anywhere else is real corruption and raises."""
    lines = text.splitlines()
    rows: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                return rows, True
            raise ValueError(f"{path}:{i + 1}: not valid JSON: {line[:80]!r}") from None
    return rows, False


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return _parse_jsonl(path.read_text(encoding="utf-8"), path)[0]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl` ([] when there is none); a torn last line is skipped."""
    return _read_jsonl(Path(run_dir) / METRICS_FILE)


def _duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: short enough for the step line."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _to_number(key: str, value: Any) -> int | float:
    """Coerce one metric to a plain Python number, or raise TypeError naming the key."""
    if not isinstance(key, str):
        raise TypeError(f"metric keys must be str, got {type(key).__name__} {key!r}")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency, but keep this module light
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex():
            raise TypeError(f"metric {key!r} must be a real 0-d tensor, got shape {tuple(value.shape)} {value.dtype}")
        value = value.item()
    # numbers.Real covers bool/int/float and numpy scalars; complex and Decimal-like types are not
    # numbers TensorBoard can plot.
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")
    if isinstance(value, bool | numbers.Integral):
        return int(value)
    return float(value)


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "nan"
    return format(value, spec)


class MetricsLogger:
    """Write per-step metrics to `out_dir/metrics.jsonl`, TensorBoard and the console.

    Usage::

        with MetricsLogger(run_dir, total_steps=200) as logger:
            for step in range(start, 200):
                logger.log(step, {"reward/mean": r, "loss/pg": l})

    With `resume=True` the existing file is kept; the first `log()` after resuming (or an explicit
    `truncate_after()`) drops the lines a crashed run wrote past its last checkpoint, so replayed
    steps are not duplicated. TensorBoard gets the same treatment through `purge_step`.
    """

    def __init__(
        self,
        out_dir: str | Path,
        tensorboard: bool = True,
        console: bool = True,
        resume: bool = False,
        *,
        total_steps: int | None = None,
        tracker: Any = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self.tensorboard_dir = self.out_dir / TENSORBOARD_DIR
        self.total_steps = total_steps
        self.resume = resume
        self._use_tb = tensorboard
        self._tb_writer: Any = None
        # anything with log(step, values) and close(), e.g. tidal.tracking.WandbTracker
        self._tracker = tracker
        # recent step durations (this process only: a resumed run's first step includes start-up)
        self._step_times: list[float] = []
        self._console: Any = None
        if console:
            from rich.console import Console

            # file=None: rich resolves sys.stdout at print time, so redirection/capture still work.
            # Non-TTY output gets plain text without escape codes, one line per step.
            self._console = Console(highlight=False)
        self._first_log = True
        self._closed = False
        # A fresh run starts an empty file; a resumed one appends after what survived.
        self._file: IO[str] | None = open(self.path, "a" if resume else "w", encoding="utf-8")

    # -- file handling ------------------------------------------------------------------------

    def truncate_after(self, step: int) -> int:
        """Keep only lines with `step <= step` in metrics.jsonl; return how many were dropped.

        The rewrite goes to a temp file in the same directory and is swapped in with os.replace,
        so a crash part-way leaves either the old file or the new one, never half of one.
        """
        self._check_open()
        assert self._file is not None
        self._file.flush()
        rows, torn = _parse_jsonl(self.path.read_text(encoding="utf-8"), self.path)
        kept = [r for r in rows if r.get("step") is not None and r["step"] <= step]
        dropped = len(rows) - len(kept)
        # Also rewrite when only a torn last line needs cleaning up, or the next append would
        # glue a new record onto it.
        if dropped == 0 and not torn:
            return 0
        self._file.close()
        fd, tmp = tempfile.mkstemp(prefix=".metrics.", suffix=".tmp", dir=self.out_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in kept:
                    f.write(json.dumps(r, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            self._file = open(self.path, "a", encoding="utf-8")
        return dropped

    def history(self) -> list[dict]:
        """Every step logged so far (including earlier runs kept on resume), in file order."""
        if self._file is not None:
            self._file.flush()
        return _read_jsonl(self.path)

    # -- logging ------------------------------------------------------------------------------

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics.

        Values must be bool/int/float (or numpy scalars) or 0-d torch tensors; anything else raises
        TypeError naming the key, before anything is written. Non-finite values become `null` in
        the JSON and are left out of TensorBoard.
        """
        self._check_open()
        assert self._file is not None
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int, got {type(step).__name__}: {step!r}")
        step = int(step)
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; pass it as the first argument")
        # Convert everything first so a bad value cannot leave a half-written step behind.
        values = {key: _to_number(key, value) for key, value in metrics.items()}

        if self._first_log:
            self._first_log = False
            if self.resume:
                # Steps >= this one were written by the run we are replacing; drop them.
                self.truncate_after(step - 1)

        record: dict[str, Any] = {"step": step}
        for key, v in values.items():
            record[key] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

        self._log_tensorboard(step, values)
        if self._tracker is not None:
            self._tracker.log(step, values)
        step_time = values.get("time/step")
        if step_time is not None and math.isfinite(step_time):
            self._step_times = [*self._step_times[-9:], float(step_time)]
        if self._console is not None:
            self._console.print(self.format_line(step, values), soft_wrap=True, markup=False)

    def _log_tensorboard(self, step: int, values: dict[str, int | float]) -> None:
        if not self._use_tb:
            return
        if self._tb_writer is None:
            self._tb_writer = self._open_tensorboard(step)
            if self._tb_writer is None:
                self._use_tb = False
                return
        for key, v in values.items():
            if math.isfinite(v):
                self._tb_writer.add_scalar(key, v, step)
        # Flush per step: steps are seconds apart, and a killed run should keep its curves.
        self._tb_writer.flush()

    def _open_tensorboard(self, first_step: int) -> Any:
        global _tb_warned
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # ImportError, or a broken protobuf/tensorboard install
            if not _tb_warned:
                _tb_warned = True
                warnings.warn(
                    f"TensorBoard logging disabled ({type(e).__name__}: {e}); metrics still go to {self.path}",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None
        # purge_step hides events a crashed run wrote at or after the step we resume from.
        return SummaryWriter(str(self.tensorboard_dir), purge_step=first_step if self.resume else None)

    def format_line(self, step: int, metrics: dict[str, Any]) -> str:
        """The one-line console summary for a step (about 125 columns at most)."""

        def get(*keys: str) -> float | None:
            for key in keys:
                v = metrics.get(key)
                if v is not None:
                    return v
            return None

        width = len(str(self.total_steps)) if self.total_steps else 4
        step_part = f"step {step:>{width}}" + (f"/{self.total_steps}" if self.total_steps else "")
        parts = [step_part]
        reward = get("reward/mean")
        if reward is not None:
            std = get("reward/std")
            spread = f"±{_fmt(std, '.3f')}" if std is not None else ""
            parts.append(f"reward {_fmt(reward, '.3f')}{spread}")
        length = get("response/length_mean")
        if length is not None:
            trunc = get("response/truncated_ratio")
            cut = f" ({_fmt(trunc, '.0%')} cut)" if trunc is not None else ""
            parts.append(f"len {_fmt(length, '.1f')}{cut}")
        for label, keys, spec in (
            ("pg", ("loss/pg",), "+.4f"),
            ("nll", ("loss/sft",), ".4f"),
            # The KL penalty term when the trainer uses one, else the policy-shift diagnostic.
            ("kl", ("loss/kl", "actor/approx_kl"), ".3g"),
            ("gnorm", ("actor/grad_norm",), ".3g"),
        ):
            v = get(*keys)
            if v is not None:
                parts.append(f"{label} {_fmt(v, spec)}")
        tok_s = get("perf/rollout_tokens_per_s")
        if tok_s is not None:
            parts.append(f"{_fmt(tok_s, '.0f')} tok/s")
        step_time = get("time/step")
        if step_time is not None:
            parts.append(f"{_fmt(step_time, '.1f')}s")
        eta = self.eta(step)
        if eta is not None:
            parts.append(f"eta {_duration(eta)}")
        return "  ".join(parts)

    def eta(self, step: int) -> float | None:
        """Seconds left until `total_steps`, from the mean of the last 10 logged step times."""
        if not self.total_steps or not self._step_times or step >= self.total_steps:
            return None
        return (self.total_steps - step) * sum(self._step_times) / len(self._step_times)

    # -- lifetime -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.out_dir} is closed")

    def close(self) -> None:
        """Flush and close the JSONL file and the TensorBoard writer; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- end-of-run summary -------------------------------------------------------------------------

_TABLE_COLUMNS = (("response/length_mean", ".1f"), ("response/truncated_ratio", ".3f"))


def reward_table(history: list[dict], key: str = "reward/mean", first: int = 3, last: int = 3) -> str:
    """Plain-text table of step vs `key` (plus response length / truncation when logged) for every
    step, then a line comparing the mean over the first `first` and last `last` steps that have a
    value. Meant for the end of a run and for CI logs, so it uses no colour or box characters.
    """
    rows = sorted((r for r in history if "step" in r), key=lambda r: r["step"])
    columns = [("step", "d"), (key, ".4f")]
    columns += [(c, spec) for c, spec in _TABLE_COLUMNS if c != key and any(c in r for r in rows)]

    cells = [[name for name, _ in columns]]
    for r in rows:
        cells.append([_fmt(r.get(name), spec) for name, spec in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]

    # Only steps with a finite value count; a NaN step (written as null) would poison the mean.
    vals = [
        float(r[key])
        for r in rows
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool) and math.isfinite(r[key])
    ]
    if vals:
        n, m = min(first, len(vals)), min(last, len(vals))
        a = sum(vals[:n]) / n if n else math.nan
        b = sum(vals[-m:]) / m if m else math.nan
        lines.append(f"mean reward over first {n} steps: {a:.3f}; over last {m} steps: {b:.3f}")
    else:
        lines.append(f"no {key!r} values logged")
    return "\n".join(lines)


def print_reward_table(
    history: list[dict],
    key: str = "reward/mean",
    first: int = 3,
    last: int = 3,
    console: Any = None,
) -> None:
    """Print `reward_table(...)` through a rich console (a new one on stdout unless given)."""
    if console is None:
        from rich.console import Console

        console = Console(highlight=False)
    console.print(reward_table(history, key=key, first=first, last=last), markup=False, soft_wrap=True)


# Loggers of the libraries tidal's processes use whose INFO lines are per request or per file: an
# agent's `openai` client logs every call to the agent door (`HTTP Request: POST ...`, through
# httpx2), the engine clients and the judge through httpx. At INFO they bury the step lines.
QUIET_LOGGERS = (
    "httpx",
    "httpx2",
    "httpcore",
    "httpcore2",
    "openai",
    "anthropic",
    "urllib3",
    "huggingface_hub",
    "transformers",
    "filelock",
    "peft",
)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# bars the user turned off before tidal set the variable stay off, terminal or not
_BARS_OFF_BY_USER = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("1", "true", "yes", "on")
LOG_LEVEL_ENV = "TIDAL_LOG_LEVEL"


def log_level() -> str:
    """`TIDAL_LOG_LEVEL` (default INFO), upper-cased."""
    return os.environ.get(LOG_LEVEL_ENV, "INFO").upper() or "INFO"


def quiet_libraries(level: str | None = None, terminal: bool | None = None) -> None:
    """The `QUIET_LOGGERS` at WARNING, unless `level` (default `TIDAL_LOG_LEVEL`) is DEBUG, where
    their request lines are what one is looking for; and the Hugging Face progress bars ("Loading
    weights", "Writing model shards", downloads) only when `terminal` (default: stderr, where
    they draw, is a terminal, and HF_HUB_DISABLE_PROGRESS_BARS did not turn them off before
    tidal started). The bars' switch also goes into the environment
    (HF_HUB_DISABLE_PROGRESS_BARS), so the processes this one starts (reward workers, a local Ray's
    actors, engine servers) inherit it."""
    if (level or log_level()) != "DEBUG":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        # one library's deprecation notice about another's use of it (peft reads transformers'
        # old property when it wraps a model to merge a LoRA adapter): nothing a user can change
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    if terminal is None:
        terminal = _isatty(sys.stderr)
    show_progress_bars(terminal and not _BARS_OFF_BY_USER)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def show_progress_bars(on: bool) -> None:
    """Turn the Hugging Face libraries' tqdm bars on or off, in this process and (through the
    environment) in the processes it starts."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0" if on else "1"
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    if on:
        enable_progress_bars()
        hf_logging.enable_progress_bar()
    else:
        disable_progress_bars()
        hf_logging.disable_progress_bar()


def setup_logging() -> None:
    """Log lines with a time stamp at `TIDAL_LOG_LEVEL` (default INFO), libraries' chatter quiet
    (`quiet_libraries`)."""
    level = log_level()
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt="%H:%M:%S")
    quiet_libraries(level)


def setup_worker_logging() -> None:
    """`setup_logging` for a process tidal starts that is not the command's own (a Ray actor):
    tidal's lines at `TIDAL_LOG_LEVEL` on stderr, which Ray forwards to the driver's console with
    the actor's name; the libraries quiet and no progress bars (a worker's stderr is a log file,
    never a terminal). Calling it again changes nothing."""
    level = log_level()
    tidal_log = logging.getLogger("tidal")
    tidal_log.setLevel(level)
    if not any(getattr(h, "_tidal", False) for h in tidal_log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
        handler._tidal = True  # type: ignore[attr-defined]
        tidal_log.addHandler(handler)
        tidal_log.propagate = False  # a root handler Ray or the user set up would print each line twice
    quiet_libraries(level, terminal=False)
