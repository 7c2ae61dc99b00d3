"""`tidal report`: one HTML page with the run's curves and sample tables, and nothing fetched."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_samples

from tidal.cli import main
from tidal.report import _label, build_report, panels_for, pick_steps, reward_used
from tidal.samples_log import record_step


def _run(tmp_path, steps=4):
    rows = []
    for k in range(1, steps + 1):
        row = {
            "step": k,
            "reward/mean": 0.1 * k,
            "reward/std": 0.05,
            "response/length_mean": 30.0 + k,
            "response/length_max": 48,
            "response/truncated_ratio": 0.25,
            "actor/approx_kl": 0.001 * k,
            "actor/entropy": 1.5 - 0.1 * k,
            "actor/clip_frac": 0.01,
            "loss/pg": -0.01,
            "actor/grad_norm": 0.5,
            "perf/rollout_tokens_per_s": 100.0 + k,
            "perf/train_tokens_per_s": 900.0,
            "time/step": 9.0,
            "time/rollout": 6.0,
            "time/trainer_idle": 6.0,
            "engine/prefill_tokens": 120.0,
            "engine/cached_tokens": 360.0,
            "engine/decode_tokens": 30.0 * k,
        }
        if k % 2 == 0:
            row.update({"eval/gsm/mean_reward": 0.2 * k, "eval/arith/mean_reward": 0.1, "eval/gsm/pass@1": 0.3})
        rows.append(row)
        samples = make_samples(n=4)
        for i, s in enumerate(samples):
            s.prompt, s.response, s.reward = f"prompt <{k}>", f"response {k}.{i} & <b>bold</b>", float(i % 2)
            s.group_index = i // 2
        record_step(tmp_path, k, samples)
    rows[1]["actor/entropy"] = None  # a NaN step, written as null, is skipped in the plot
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"train": {"model": "smollm2", "num_steps": 9}}))
    return tmp_path


def test_page_has_the_curves_and_sample_rows_and_no_network_references(tmp_path):
    page = build_report(_run(tmp_path), sample_steps=3)
    titles = [
        "Reward",
        "Eval: mean_reward",
        "Eval: pass@1",
        "Response length (tokens)",
        "Truncated / failed share",
        "KL",
        "Entropy",
        "Clip fraction",
        "Policy loss",
        "Gradient norm",
        "Throughput (tokens/s)",
        "Engine tokens",
        "Time (s)",
    ]
    assert page.count("<svg") == len(titles)
    svg_titles = re.findall(r"<text [^>]*>([^<]*)</text>", page)
    for title in titles:
        assert title in svg_titles, title
    assert "Not logged in this run: Reward parts, Engine preemptions" in page
    # samples: steps 1, 3, 4 of 4 (evenly spread, first and last), escaped, newest open
    assert "3 of 4 steps with saved samples" in page
    assert [int(s) for s in re.findall(r'<details class="step" id="step-(\d+)"', page)] == [4, 3, 1]
    assert '<details class="step" id="step-4" open>' in page
    rows = re.findall(r"<tr(?: class=\"good\")?><td>(\d+)\.(\d+)</td>", page)
    assert len(rows) == 12 and page.count('<tr class="good">') == 6  # rewards 0, 1, 0, 1 per step
    # a group's prompt once, spanning its 2 rows: 2 groups x 3 steps
    assert page.count('<td class="prompt" rowspan="2"><div class="text">prompt &lt;') == 6
    assert "response 3.1 &amp; &lt;b&gt;bold&lt;/b&gt;" in page and "<b>bold" not in page
    assert "prompt &lt;4&gt;" in page
    # self-contained: no URL at all, no external script, style, image or font
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\((?!#)", page)  # url(#id): the SVG's own


def test_panels_skip_missing_and_non_finite_values():
    history = [{"step": 1, "reward/mean": 0.5, "reward/std": 0.1}, {"step": 2, "reward/mean": None}]
    panels, missing = panels_for(history)
    assert [p.title for p in panels] == ["Reward"]
    assert panels[0].series == {"reward/mean": [(1, 0.5)]} and panels[0].band == ("reward/mean", [(1, 0.1)])
    assert "KL" in missing and "Eval" in missing


def test_legend_labels_drop_the_shared_path():
    evals = ["eval/gsm/pass@1", "eval/math/pass@1"]
    assert [_label(k, evals) for k in evals] == ["gsm", "math"]
    lengths = ["response/length_mean", "response/length_max"]
    assert [_label(k, lengths) for k in lengths] == ["length_mean", "length_max"]
    kl = ["loss/kl", "actor/approx_kl"]
    assert [_label(k, kl) for k in kl] == kl
    assert _label("reward/mean", ["reward/mean"]) == "reward/mean"


def test_pick_steps():
    assert pick_steps([5, 1, 3], 10) == [1, 3, 5]
    assert pick_steps(list(range(1, 101)), 3) == [1, 51, 100]  # indices 0, round(49.5) = 50, 99
    assert pick_steps(list(range(1, 101)), 1) == [100]
    assert pick_steps([1, 2], 0) == []


def test_cli_writes_the_page_and_names_a_wrong_folder(tmp_path, capsys):
    run = _run(tmp_path / "run", steps=2)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").read_text().startswith("<!DOCTYPE html>")
    out = tmp_path / "elsewhere" / "r.html"
    out.parent.mkdir()
    assert main(["report", str(run), "--out", str(out), "--sample-steps", "1"]) == 0
    assert "1 of 2 steps with saved samples" in out.read_text()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == f"tidal report: {tmp_path / 'nope'} has no metrics.jsonl: not a tidal run folder (train.output_dir)"
    )


def test_a_key_in_config_json_never_reaches_the_page(tmp_path):
    """A run an older tidal wrote holds the key in its config.json; the shareable page masks it."""
    run = _run(tmp_path / "run", steps=2)
    key = "sk-old-run-0123456789"
    (run / "config.json").write_text(json.dumps({"train": {"num_steps": 9}, "rollout": {"api_key": key}}))
    page = build_report(run)
    assert key not in page
    assert "&quot;api_key&quot;: &quot;&lt;redacted&gt;&quot;" in page


def test_a_run_without_samples_still_reports(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    page = build_report(tmp_path)
    assert "no samples saved in this run" in page and page.count("<svg") == 1
    with pytest.raises(FileNotFoundError):
        build_report(tmp_path / "missing")


@pytest.mark.slow  # a browser start: seconds alone, a minute on a busy 2-core machine
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_screenshot_script_renders_the_page_offline(tmp_path):
    from PIL import Image

    run = _run(tmp_path / "run", steps=3)
    png = tmp_path / "shot.png"
    script = Path(__file__).resolve().parents[1] / "scripts" / "report_screenshot.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(script), str(run), str(png), "900,1200"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    with Image.open(png) as im:
        assert im.size == (900, 1200)
        # drawn, not blank: the plots' blue line colour (#1f77b4) is on the page
        colours = {c for _, c in im.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert (0x1F, 0x77, 0xB4) in colours
    assert not (run / "report.html").exists()  # the page went to a temporary folder


def test_the_header_names_the_reward_actually_used():
    agent = {"rollout": {"generate": "agent"}, "agent": {"fn": "examples.coding_agent.agent:run"}}
    by_agent = [{"metadata": {"reward_from": "agent.fn"}}] * 3
    by_fn = [{"metadata": {"agent_calls": []}}]
    assert reward_used({"reward": {"fn": "math"}}) == "math (built-in reward.fn)"
    assert reward_used({"reward": {"fn": "myrl.rewards:fn"}}) == "myrl.rewards:fn (reward.fn)"
    assert (
        reward_used({"reward": {"fn": "math", "group_fn": "judges:rank"}})
        == "group reward judges:rank (reward.group_fn)"
    )
    judge = {"reward": {"fn": "judge"}, "judge": {"model": "qwen", "url": "http://127.0.0.1:8001/v1"}}
    assert reward_used(judge) == "the LLM judge qwen at http://127.0.0.1:8001/v1 (reward.fn judge)"
    local = {"reward": {"fn": "judge"}, "judge": {"model": "judge", "url": "", "path": "/models/judge"}}
    assert reward_used(local) == "the LLM judge /models/judge, served by tidal (reward.fn judge)"
    assert (
        reward_used({**agent, "reward": {"fn": "math"}}, by_agent)
        == "the agent's own (examples.coding_agent.agent:run)"
    )
    assert reward_used({**agent, "reward": {"fn": "code_tests"}}, by_fn) == (
        "code_tests (built-in reward.fn): the agent returned none"
    )
    assert reward_used({**agent, "reward": {"fn": "math"}}, by_agent + by_fn) == (
        "the agent's own (examples.coding_agent.agent:run) for 3 of 4 samples shown, math (built-in reward.fn) "
        "for the rest"
    )
    # samples kept without metadata (an older run): what the config allows
    assert reward_used({**agent, "reward": {"fn": "math"}}, [{"reward": 1.0}]) == (
        "the agent's own (examples.coding_agent.agent:run) where it returned one, else math (built-in reward.fn)"
    )
    custom = {"rollout": {"generate": "my_env:generate"}, "reward": {"fn": "math"}}
    assert reward_used(custom) == "math (built-in reward.fn), where rollout.generate my_env:generate set none"
    assert reward_used({"algo": {"mode": "sft"}, "reward": {"fn": "math"}}) is None


def test_the_page_header_has_the_reward(tmp_path):
    run = _run(tmp_path)
    config = {"train": {"model": "smollm2", "num_steps": 9}, "reward": {"fn": "myrl.rewards:fn"}}
    (run / "config.json").write_text(json.dumps(config))
    page = build_report(run)
    assert "· reward: myrl.rewards:fn (reward.fn) ·" in page
