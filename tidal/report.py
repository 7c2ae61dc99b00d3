"""`tidal report RUN_DIR`: one self-contained HTML page about a run.

The page holds the run's curves (reward, eval, response length, KL, entropy, clip fraction, losses,
throughput, timings) drawn by matplotlib as inline SVG, a summary table, the config, and the kept
samples (`tidal.samples_log`) as one collapsible table per step. It references nothing outside
itself: no scripts, fonts or styles from a network, so it opens from a file anywhere.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tidal.config import redact, upgrade
from tidal.log import read_metrics, reward_table
from tidal.samples_log import SAMPLES_DIR, read_samples, saved_steps

__all__ = ["Panel", "build_report", "panels_for", "pick_steps", "reward_used", "write_report"]

# Long texts are cut in the tables so a run with thousands of samples stays a page a browser opens.
_MAX_TEXT = 4000


@dataclass
class Panel:
    """One plot: a title and the metric series drawn in it, `{key: [(step, value), ...]}`."""

    title: str
    series: dict[str, list[tuple[int, float]]]
    band: tuple[str, list[tuple[int, float]]] | None = None  # (key, its std per step): shade key ± std


def _series(history: Sequence[dict], key: str) -> list[tuple[int, float]]:
    points = []
    for row in history:
        v, step = row.get(key), row.get("step")
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and step is not None:
            points.append((int(step), float(v)))
    return points


def _keys(history: Sequence[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for row in history:
        seen.update(dict.fromkeys(k for k in row if k != "step"))
    return list(seen)


# (title, exact keys, or a prefix ending in "/" for every key under it)
_LAYOUT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reward", ("reward/mean",)),
    ("Reward parts", ("rewards/",)),
    ("Response length (tokens)", ("response/length_mean", "response/length_max")),
    ("Truncated / failed share", ("response/truncated_ratio", "response/failed_ratio")),
    ("KL", ("loss/kl", "actor/approx_kl")),
    ("Entropy", ("actor/entropy",)),
    ("Clip fraction", ("actor/clip_frac",)),
    ("Policy loss", ("loss/pg", "loss/sft")),
    ("Gradient norm", ("actor/grad_norm",)),
    ("Throughput (tokens/s)", ("perf/",)),
    ("Engine tokens", ("engine/prefill_tokens", "engine/cached_tokens", "engine/decode_tokens")),
    ("Engine preemptions", ("engine/preemptions",)),
    ("Time (s)", ("time/",)),
)


def panels_for(history: Sequence[dict]) -> tuple[list[Panel], list[str]]:
    """The panels that have data, in page order, and the titles of those with none.

    `eval/<dataset>/<metric>` keys get one panel per metric, one line per dataset."""
    keys = _keys(history)
    panels: list[Panel] = []
    missing: list[str] = []

    def add(title: str, wanted: list[str], band: tuple[str, str] | None = None) -> None:
        series = {k: s for k in wanted if (s := _series(history, k))}
        if series:
            std = _series(history, band[1]) if band else []
            panels.append(Panel(title, series, (band[0], std) if std else None))
        else:
            missing.append(title)

    for title, spec in _LAYOUT:
        wanted = [k for s in spec for k in ([k for k in keys if k.startswith(s)] if s.endswith("/") else [s])]
        if title == "Time (s)":  # in the synchronous loop the idle times repeat the phase times
            wanted = [k for k in wanted if not k.endswith("_idle")]
        add(title, wanted, ("reward/mean", "reward/std") if title == "Reward" else None)
        if title == "Reward":  # evaluation right after the training reward
            metrics = sorted({k.rsplit("/", 1)[1] for k in keys if k.startswith("eval/") and k.count("/") >= 2})
            for m in metrics:
                add(f"Eval: {m}", [k for k in keys if k.startswith("eval/") and k.rsplit("/", 1)[1] == m])
            if not metrics:
                flat = [k for k in keys if k.startswith("eval/")]
                add("Eval", flat)
    return panels, missing


def _label(key: str, keys: Sequence[str]) -> str:
    """A legend label without the path parts every key of the panel shares at either end:
    `eval/gsm/pass@1` beside `eval/math/pass@1` is `gsm`."""
    if len(keys) == 1:
        return key
    split = [k.split("/") for k in keys]
    head = 0
    while all(len(p) > head + 1 and p[head] == split[0][head] for p in split):
        head += 1
    if head == 0:  # nothing shared in front (loss/kl beside actor/approx_kl): the full keys say it best
        return key
    tail = 0
    while all(len(p) > head + tail + 1 and p[-1 - tail] == split[0][-1 - tail] for p in split):
        tail += 1
    parts = key.split("/")
    return "/".join(parts[head : len(parts) - tail])


def _svg(panel: Panel) -> str:
    """The panel drawn as an inline `<svg>` element (no XML prolog, no external namespaces)."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rc = {
        "svg.fonttype": "none",  # text as <text>, in the browser's font: smaller than glyph paths
        "font.size": 8,
        "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial"],
        "svg.hashsalt": panel.title,  # ids (clip paths, markers) differ between the page's plots
    }
    with matplotlib.rc_context(rc):
        fig = Figure(figsize=(4.4, 2.7), layout="constrained")
        ax = fig.subplots()
        keys = list(panel.series)
        for key in keys:
            steps, values = zip(*panel.series[key], strict=True)
            ax.plot(steps, values, lw=1.4, marker="o" if len(steps) <= 30 else None, ms=3, label=_label(key, keys))
        if panel.band:
            mean, std = dict(panel.series.get(panel.band[0], [])), dict(panel.band[1])
            xs = [s for s in mean if s in std]
            if xs:
                ax.fill_between(
                    xs, [mean[s] - std[s] for s in xs], [mean[s] + std[s] for s in xs], alpha=0.15, label="± std"
                )
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(keys) > 1 or panel.band:
            ax.legend(fontsize=7, frameon=False)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    # Inline SVG in HTML needs no namespace declarations; dropping them leaves no URL on the page.
    return re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text)


def pick_steps(steps: Sequence[int], limit: int) -> list[int]:
    """At most `limit` of `steps`, evenly spread, always with the first and the last."""
    steps = sorted(steps)
    if limit <= 0:
        return []
    if len(steps) <= limit:
        return steps
    if limit == 1:
        return [steps[-1]]
    return sorted({steps[round(i * (len(steps) - 1) / (limit - 1))] for i in range(limit)})


def _cut(text: object) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + f" … [{len(text) - _MAX_TEXT} more characters]"


def _num(v: object, spec: str) -> str:
    return "–" if not isinstance(v, int | float) or isinstance(v, bool) else format(v, spec)


def _parts(parts: object) -> str:
    if not isinstance(parts, dict):
        return ""
    return ", ".join(f"{k}={_num(v, '.3g') if isinstance(v, int | float) else v}" for k, v in parts.items())


def _sample_table(step: int, rows: list[dict], open_: bool) -> str:
    """One step's samples as a collapsible table; a group's shared prompt (and label) is shown
    once, in a cell spanning the group's rows."""
    e = html.escape
    with_parts = any(isinstance(r.get("reward_parts"), dict) for r in rows)
    body = []
    for i, r in enumerate(rows):
        reward = r.get("reward")
        status = str(r.get("status", ""))
        cells = [f"<td>{e(str(r.get('group', '')))}.{e(str(r.get('index', '')))}</td>"]
        key = (r.get("group"), r.get("prompt"))
        if i == 0 or key != (rows[i - 1].get("group"), rows[i - 1].get("prompt")):
            span = 1
            while i + span < len(rows) and (rows[i + span].get("group"), rows[i + span].get("prompt")) == key:
                span += 1
            label = f'<div class="label">label: {e(_cut(r["label"]))}</div>' if r.get("label") is not None else ""
            cells.append(
                f'<td class="prompt" rowspan="{span}"><div class="text">{e(_cut(r.get("prompt")))}</div>{label}</td>'
            )
        error = f'<div class="err">{e(_cut(r["error"]))}</div>' if r.get("error") else ""
        cells.append(f'<td><div class="text">{e(_cut(r.get("response")))}</div>{error}</td>')
        cells.append(f'<td class="n">{_num(reward, ".3f")}</td>')
        if with_parts:
            cells.append(f"<td>{e(_parts(r.get('reward_parts')))}</td>")
        cells.append(f'<td class="n">{_num(r.get("advantage"), "+.3f")}</td><td class="{e(status)}">{e(status)}</td>')
        cells.append(f'<td class="n">{_num(r.get("response_length"), "d")}</td>')
        cells.append(f'<td class="n">{_num(r.get("weight_version"), "d")}</td>')
        good = ' class="good"' if isinstance(reward, int | float) and reward > 0 else ""
        body.append(f"<tr{good}>{''.join(cells)}</tr>")
    rewards = [r["reward"] for r in rows if isinstance(r.get("reward"), int | float)]
    mean = f"mean reward {sum(rewards) / len(rewards):.3f}" if rewards else "no rewards"
    heads = ["#", "prompt", "response", "reward"] + (["parts"] if with_parts else []) + ["adv", "status", "len", "ver"]
    return (
        f'<details class="step" id="step-{step}"{" open" if open_ else ""}><summary>step {step}: {len(rows)} samples, '
        f"{mean}</summary><table><thead><tr>{''.join(f'<th>{h}</th>' for h in heads)}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table></details>"
    )


# reward.fn names of the built-in rewards (tidal.reward.verifiers, tidal.reward.score)
_BUILTIN_REWARDS = ("math", "exact_match", "code_tests")


def reward_used(config: dict, records: Sequence[dict] = ()) -> str | None:
    """What scored the run's samples, from its config and the kept sample `records`: the group
    reward, the judge, `reward.fn`, or an agent's own reward (its samples say
    `metadata["reward_from"]`). None for an SFT run, which has no reward."""
    section = config.get("reward") or {}
    if (config.get("algo") or {}).get("mode") == "sft":
        return None
    if section.get("group_fn"):  # it scores every group, over any reward a generate function set
        return f"group reward {section['group_fn']} (reward.group_fn)"
    fn = section.get("fn", "math")
    if fn == "judge":
        judge = config.get("judge") or {}
        if judge.get("path"):  # a model tidal served itself: its folder says which, not a loopback port
            by = f"the LLM judge {judge['path']}, served by tidal (reward.fn judge)"
        else:
            by = f"the LLM judge {judge.get('model', 'judge')} at {judge.get('url') or '?'} (reward.fn judge)"
    elif fn in _BUILTIN_REWARDS:
        by = f"{fn} (built-in reward.fn)"
    else:
        by = f"{fn} (reward.fn)"
    generate = (config.get("rollout") or {}).get("generate", "single_turn")
    if generate != "agent":
        if generate in ("single_turn", "tools"):
            return by
        return f"{by}, where rollout.generate {generate} set none"
    agent = f"the agent's own ({(config.get('agent') or {}).get('fn', '?')})"
    records = [r for r in records if isinstance(r.get("metadata"), dict)]
    if not records:  # no samples kept, or kept by a tidal that did not keep their metadata
        return f"{agent} where it returned one, else {by}"
    mine = sum(r["metadata"].get("reward_from") == "agent.fn" for r in records)
    if mine == len(records):
        return agent
    if mine == 0:
        return f"{by}: the agent returned none"
    return f"{agent} for {mine} of {len(records)} samples shown, {by} for the rest"


_SUMMARY_KEYS = (
    "reward/mean",
    "response/length_mean",
    "response/truncated_ratio",
    "actor/entropy",
    "actor/clip_frac",
    "actor/approx_kl",
    "loss/pg",
    "perf/rollout_tokens_per_s",
    "time/step",
)

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#555}.grid{display:flex;flex-wrap:wrap;gap:8px}.grid svg{width:440px;height:auto;border:1px solid #eee}
table{border-collapse:collapse;font-size:12px;margin:6px 0}th,td{border:1px solid #ddd;padding:3px 6px;
vertical-align:top;text-align:left}th{background:#f4f4f4}td.n{text-align:right}
.text{white-space:pre-wrap;max-height:12em;overflow:auto;max-width:560px;font-family:ui-monospace,monospace}
tr.good{background:#eefaf0}td.prompt{background:#fff}td.failed{color:#b00;font-weight:600}td.truncated{color:#a60}.label{color:#555;margin-top:4px}
.err{color:#b00;font-size:11px}details.step{margin:4px 0}summary{cursor:pointer;font-weight:600}
pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:12px}
"""

_JS = """
const sel=document.getElementById('pick');
if(sel){sel.addEventListener('change',()=>{const d=document.getElementById('step-'+sel.value);
if(d){d.open=true;d.scrollIntoView();}});}
"""


def build_report(run_dir: str | Path, sample_steps: int = 50) -> str:
    """The HTML page for `run_dir` (a `train.output_dir`), with the samples of at most
    `sample_steps` steps (evenly spread, first and last included).

    Raises FileNotFoundError when `run_dir` has no metrics.jsonl."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a tidal run folder (train.output_dir)")
    history = read_metrics(run_dir)
    config_file = run_dir / "config.json"
    # masked again here: a config.json written by an older tidal may still hold a key
    config = redact(upgrade(json.loads(config_file.read_text(encoding="utf-8")))) if config_file.exists() else {}
    e = html.escape

    panels, missing = panels_for(history)
    plots = "".join(_svg(p) for p in panels)

    summary_rows = []
    for key in _SUMMARY_KEYS:
        s = _series(history, key)
        if s:
            vals = [v for _, v in s]
            summary_rows.append(
                f"<tr><td>{e(key)}</td>"
                + "".join(f'<td class="n">{v:.4g}</td>' for v in (vals[0], vals[-1], min(vals), max(vals)))
                + "</tr>"
            )

    steps = saved_steps(run_dir / SAMPLES_DIR)
    shown = pick_steps(steps, sample_steps)
    samples = read_samples(run_dir, shown)
    tables = "".join(_sample_table(k, samples[k], open_=k == shown[-1]) for k in reversed(shown))
    options = "".join(f'<option value="{k}">step {k}</option>' for k in reversed(shown))
    note = f"{len(shown)} of {len(steps)} steps with saved samples" if steps else "no samples saved in this run"

    def cfg(group: str, key: str) -> object:
        return config.get(group, {}).get(key)

    last = history[-1]["step"] if history else 0
    title = f"tidal run {run_dir.resolve().name}"
    facts = [str(run_dir.resolve()), f"step {last}" + (f" of {cfg('train', 'num_steps')}" if config else "")]
    for label, group, key in (
        ("model", "train", "model"),
        ("advantage", "algo", "advantage"),
        ("data", "data", "path"),
    ):
        if cfg(group, key) is not None:
            facts.append(f"{label} {cfg(group, key)}")
    reward = reward_used(config, [r for rows in samples.values() for r in rows]) if config else None
    if reward is not None:
        facts.append(f"reward: {reward}")
    if cfg("train", "lr") is not None:
        facts.append(f"lr {cfg('train', 'lr')}")
    if cfg("rollout", "rollout_batch_size") is not None:
        facts.append(f"{cfg('rollout', 'rollout_batch_size')} prompts × {cfg('rollout', 'n_samples_per_prompt')}")
    facts.append("generated " + datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title><style>{_CSS}</style></head><body>
<h1>{e(title)}</h1>
<div class="meta">{e(" · ".join(facts))}</div>
<h2>Curves</h2><div class="grid">{plots}</div>
<p class="meta">{"Not logged in this run: " + e(", ".join(missing)) if missing else ""}</p>
<h2>Summary</h2><table><thead><tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th></tr></thead>
<tbody>{"".join(summary_rows)}</tbody></table>
<pre>{e(reward_table(history))}</pre>
<h2>Samples</h2><p class="meta">{note}.
{f'Jump to <select id="pick">{options}</select>' if shown else ""}</p>{tables}
<h2>Config</h2><details><summary>config.json</summary><pre>{e(json.dumps(config, indent=2))}</pre></details>
<script>{_JS}</script></body></html>
"""


def write_report(run_dir: str | Path, out: str | Path | None = None, sample_steps: int = 50) -> Path:
    """Write `build_report(run_dir)` to `out` (default `RUN_DIR/report.html`); returns the path."""
    from tidal.utils import atomic_write_text

    path = Path(out) if out else Path(run_dir) / "report.html"
    atomic_write_text(path, build_report(run_dir, sample_steps))
    return path
