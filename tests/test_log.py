"""MetricsLogger: JSONL content, NaN handling, type checks, resume truncation, TensorBoard,
console line and the end-of-run reward table."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tidal.log import MetricsLogger, print_reward_table, reward_table


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_jsonl_exact_content(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(0, {"reward/mean": 0.5, "loss/pg": -1.25})
        logger.log(1, {"reward/mean": 0.75, "actor/clip_frac": torch.tensor(0.25)})
        logger.log(2, {"reward/mean": 1, "flag": True})
    assert _lines(tmp_path / "metrics.jsonl") == [
        '{"step": 0, "reward/mean": 0.5, "loss/pg": -1.25}',
        '{"step": 1, "reward/mean": 0.75, "actor/clip_frac": 0.25}',
        '{"step": 2, "reward/mean": 1, "flag": 1}',
    ]


def test_line_is_flushed_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False)
    logger.log(0, {"x": 1.0})
    # A run killed now must still have the step on disk.
    assert json.loads(_lines(tmp_path / "metrics.jsonl")[0]) == {"step": 0, "x": 1.0}
    assert logger.history() == [{"step": 0, "x": 1.0}]
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"x": 1.0})


def test_non_finite_values_become_null(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(0, {"a": float("nan"), "b": float("inf"), "c": torch.tensor(float("-inf")), "d": 2.0})
    (line,) = _lines(tmp_path / "metrics.jsonl")
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 0, "a": None, "b": None, "c": None, "d": 2.0}


@pytest.mark.parametrize("bad", ["0.5", None, [1.0], torch.ones(2), 1 + 2j])
def test_non_number_raises_type_error_naming_key(tmp_path, bad):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        with pytest.raises(TypeError, match="reward/oops"):
            logger.log(0, {"reward/mean": 1.0, "reward/oops": bad})
    # Nothing of the rejected step reaches the file.
    assert _lines(tmp_path / "metrics.jsonl") == []


def test_truncate_after_keeps_steps_up_to_k(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        for step in range(6):
            logger.log(step, {"x": float(step)})
        assert logger.truncate_after(2) == 3
        logger.log(3, {"x": 30.0})  # appends after the rewrite
    assert [r["step"] for r in logger.history()] == [0, 1, 2, 3]
    assert logger.history()[-1] == {"step": 3, "x": 30.0}
    assert not list(tmp_path.glob(".metrics.*"))  # no temp file left behind


def test_resume_drops_steps_from_first_logged_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        for step in range(5):
            logger.log(step, {"x": float(step)})
    # Simulate a crash mid-write: a torn last line.
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 5, "x"')
    with MetricsLogger(tmp_path, tensorboard=False, console=False, resume=True) as logger:
        logger.log(3, {"x": 33.0})
        logger.log(4, {"x": 44.0})
    rows = [json.loads(line) for line in _lines(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 0, "x": 0.0}, {"step": 1, "x": 1.0}, {"step": 2, "x": 2.0},
                    {"step": 3, "x": 33.0}, {"step": 4, "x": 44.0}]  # fmt: skip


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(0, {"reward/mean": 0.5, "loss/kl": float("nan")})
        logger.log(1, {"reward/mean": 0.75, "loss/kl": 0.125})
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.5), (1, 0.75)]
    # The NaN at step 0 was skipped, not plotted.
    assert [(e.step, e.value) for e in acc.Scalars("loss/kl")] == [(1, 0.125)]


def test_console_line(tmp_path, capsys):
    metrics = {
        "reward/mean": -0.41234,
        "reward/std": 0.3123,
        "response/length_mean": 153.24,
        "response/truncated_ratio": 0.05,
        "loss/pg": -0.01234,
        "loss/kl": 0.00123,
        "actor/grad_norm": 0.8412,
        "time/step": 123.21,
        "perf/train_tokens_per_s": 12345.6,
        "perf/rollout_tokens_per_s": 456.7,
    }
    with MetricsLogger(tmp_path, tensorboard=False, total_steps=1000) as logger:
        logger.log(120, metrics)
        logger.log(121, {**metrics, "time/step": 76.79})
    out = capsys.readouterr().out
    # Not a TTY under capture: one plain line per step, no escape codes, fits 125 columns.
    assert out.count("\n") == 2 and "\x1b" not in out
    first, second = out.splitlines()
    assert max(len(first), len(second)) <= 125
    pieces = ("120/1000", "-0.412±0.312", "153.2", "5%", "-0.0123", "0.00123", "0.841", "457 tok/s", "123.2s")
    for piece in pieces:
        assert piece in first
    # ETA = steps left x mean step time so far: 880 x 123.21 s = 30h07m, then 879 x 100 s = 24h25m
    assert first.endswith("eta 30h07m") and second.endswith("76.8s  eta 24h25m")


def test_reward_table_summary_exact():
    history = [
        {"step": 0, "reward/mean": 0.0, "response/length_mean": 10.0},
        {"step": 1, "reward/mean": 0.25, "response/length_mean": 12.0},
        {"step": 2, "reward/mean": None, "response/length_mean": 12.5},  # a NaN step
        {"step": 3, "reward/mean": 0.5, "response/length_mean": 14.0},
        {"step": 4, "reward/mean": 1.0, "response/length_mean": 20.0},
    ]
    text = reward_table(history, first=2, last=2)
    lines = text.splitlines()
    assert lines[0].split() == ["step", "reward/mean", "response/length_mean"]
    assert len(lines) == 1 + len(history) + 1  # header, every step, summary
    assert lines[3].split() == ["2", "-", "12.5"]
    assert lines[-1] == "mean reward over first 2 steps: 0.125; over last 2 steps: 0.750"
    # More steps requested than logged: n and m shrink to what exists.
    short = reward_table(history[:1])
    assert short.splitlines()[-1] == "mean reward over first 1 steps: 0.000; over last 1 steps: 0.000"
    assert "response/truncated_ratio" not in text
    with_trunc = reward_table([{"step": 7, "reward/mean": 0.5, "response/truncated_ratio": 0.25}])
    assert with_trunc.splitlines()[1].split() == ["7", "0.5000", "0.250"]


def test_print_reward_table(capsys):
    print_reward_table([{"step": 0, "reward/mean": 1.0}, {"step": 1, "reward/mean": 0.0}])
    out = capsys.readouterr().out
    assert "mean reward over first 2 steps: 0.500; over last 2 steps: 0.500" in out


def test_missing_tensorboard_warns_once_and_keeps_logging(tmp_path, monkeypatch):
    import sys

    import tidal.log

    # A None entry in sys.modules makes the import raise ImportError.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(tidal.log, "_tb_warned", False)
    with pytest.warns(RuntimeWarning, match="TensorBoard logging disabled") as record:
        for i in range(2):
            with MetricsLogger(tmp_path / str(i), console=False) as logger:
                logger.log(0, {"x": 1.0})
                logger.log(1, {"x": 2.0})
    assert len(record) == 1
    assert [r["x"] for r in logger.history()] == [1.0, 2.0]


@pytest.fixture
def restore_logging(monkeypatch):
    """Library logger levels, tidal's handlers and the progress-bar switch as they were."""
    import logging

    from transformers.utils import logging as hf_logging

    from tidal.log import QUIET_LOGGERS

    names = (*QUIET_LOGGERS, "tidal")
    levels = {n: logging.getLogger(n).level for n in names}
    tidal_log = logging.getLogger("tidal")
    handlers, propagate = list(tidal_log.handlers), tidal_log.propagate
    bars = hf_logging.is_progress_bar_enabled()
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", ""))
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)
    tidal_log.handlers[:], tidal_log.propagate = handlers, propagate
    from tidal.log import show_progress_bars

    show_progress_bars(bars)


def test_the_agents_http_client_logs_no_request_lines(restore_logging, monkeypatch, caplog):
    import logging

    import anthropic
    import openai

    from tidal.log import QUIET_LOGGERS, quiet_libraries

    monkeypatch.delenv("TIDAL_LOG_LEVEL", raising=False)

    # the packages an agent uses log their requests through their own HTTP library (httpx2 for
    # openai 3): the first class of the client's that is not the package's own wrapper
    def http_library(client, own):
        return next(
            c.__module__.split(".")[0] for c in type(client._client).__mro__ if c.__module__.split(".")[0] != own
        )

    used = {
        http_library(openai.AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9/v1"), "openai"),
        http_library(anthropic.AsyncAnthropic(api_key="k", base_url="http://127.0.0.1:9"), "anthropic"),
    }
    assert used <= set(QUIET_LOGGERS)
    quiet_libraries(terminal=False)
    with caplog.at_level(logging.INFO):
        for name in used | {"openai", "anthropic"}:
            logging.getLogger(name).info('HTTP Request: POST http://127.0.0.1:9/v1/chat/completions "HTTP/1.1 200 OK"')
            logging.getLogger(name).warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"] * (len(used) + 2)


def test_debug_keeps_the_request_lines(restore_logging, monkeypatch):
    import logging

    from tidal.log import quiet_libraries

    monkeypatch.setenv("TIDAL_LOG_LEVEL", "debug")
    logging.getLogger("httpx2").setLevel(logging.NOTSET)
    quiet_libraries(terminal=False)
    assert logging.getLogger("httpx2").level == logging.NOTSET


def test_progress_bars_only_on_a_terminal(restore_logging, monkeypatch):
    from transformers.utils import logging as hf_logging

    import tidal.log
    from tidal.log import quiet_libraries

    monkeypatch.setattr(tidal.log, "_BARS_OFF_BY_USER", False)
    quiet_libraries(terminal=False)
    assert not hf_logging.is_progress_bar_enabled() and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    quiet_libraries(terminal=True)
    assert hf_logging.is_progress_bar_enabled() and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"
    # HF_HUB_DISABLE_PROGRESS_BARS=1 set before tidal started keeps them off on a terminal too
    monkeypatch.setattr(tidal.log, "_BARS_OFF_BY_USER", True)
    quiet_libraries(terminal=True)
    assert not hf_logging.is_progress_bar_enabled()


def test_a_worker_prints_tidals_lines_once_without_bars(restore_logging, monkeypatch, capsys):
    import logging

    from transformers.utils import logging as hf_logging

    from tidal.log import setup_worker_logging

    monkeypatch.delenv("TIDAL_LOG_LEVEL", raising=False)
    setup_worker_logging()
    setup_worker_logging()  # a second call adds no second handler
    logging.getLogger("tidal").info("trainer rank 0 of 1 (pid 1): ready")
    logging.getLogger("tidal").debug("not at INFO")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith(" INFO tidal: trainer rank 0 of 1 (pid 1): ready")
    assert not hf_logging.is_progress_bar_enabled()
    assert logging.getLogger("httpx2").level == logging.WARNING
