"""docs/metrics.md lists every metric key tidal logs, and no key it does not: the keys are read
from the code (string literals and f-strings of the metric groups), from the functions whose
result names become keys, and from a tiny run's metrics.jsonl with most features on."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import torch
from conftest import loop_config

import tidal.loop
from tidal.algo.corrections import importance_weights
from tidal.algo.losses import cispo_loss, policy_loss
from tidal.train.update import step_norm_metrics

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
ANY = "<>"  # one path part whose text varies: a dataset name, a dict reward's key, k of pass@k
# keys the code builds but does not log: the loop folds the overlapped push's wait into time/trainer_idle
NOT_LOGGED = {"time/push_wait"}


def documented() -> set[str]:
    keys = re.findall(r"^\| `([a-z_]+/[^`]+)` \|", DOC.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"<[^>]*>", ANY, k) for k in keys}


def as_pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(re.escape(ANY), r"[^/]+") + "$")


def matches(key: str, keys: set[str]) -> bool:
    """Whether `key` is one of `keys`, a placeholder on either side standing for any one part."""
    return key in keys or any(as_pattern(k).match(key) or as_pattern(key).match(k) for k in keys)


def code_keys() -> set[str]:
    """String literals and f-strings in tidal/ that start with one of the documented groups
    (`reward/`, `actor/`, ...); an f-string's fields become placeholders."""
    groups = {k.split("/")[0] for k in documented()}
    found = set()
    for path in (ROOT / "tidal").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if id(node) in parts:  # a piece of an f-string, read with it
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else ANY for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if re.fullmatch(r"[a-z_]+/[A-Za-z0-9_@<>/]*[A-Za-z0-9_>]", text) and text.split("/")[0] in groups:
                found.add(text)
    return found


def function_keys() -> set[str]:
    """Keys named by what functions return: the losses' metrics (as actor/<name>), the
    train/rollout correction's (is/<name>), the step norms (actor/, critic/)."""
    t = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    names = set(policy_loss(t, t, t + 1, mask, dual_clip=3.0)[1]) | set(cispo_loss(t, t, t + 1, mask)[1])
    keys = {f"actor/{k}" for k in names}
    for mode in ("truncate", "mask"):
        keys |= {f"is/{k}" for k in importance_weights(t, t, mask, mode=mode)[1]}
    for prefix in ("actor", "critic"):
        keys |= set(step_norm_metrics(prefix, [1.0]))
    return keys


def run_keys(model_dir, out_dir) -> set[str]:
    over = {
        "train.num_steps": 1,
        "rollout.rollout_batch_size": 2,
        "algo.kl_coef": 0.05,
        "algo.is_correction": "truncate",
        "eval.interval": 1,
        "eval.at_start": False,
        "eval.pass_k": [1, 2],
        "eval.datasets": [{"name": "arith", "path": "env:arithmetic", "env_args": {"n": 2, "seed": 1}, "n": 2}],
    }
    tidal.loop.train(loop_config(model_dir, out_dir, **over))
    keys = set()
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        for key in json.loads(line):
            if key == "step":
                continue
            key = re.sub(r"^eval/[^/]+/", f"eval/{ANY}/", key)
            keys.add(re.sub(r"@\d+$", "@" + ANY, key))
    return keys


def test_every_key_the_code_names_is_documented():
    doc = documented()
    missing = sorted(k for k in (code_keys() | function_keys()) - NOT_LOGGED if not matches(k, doc))
    assert missing == []


def test_every_documented_key_is_one_the_code_logs(tiny_model_dir, tmp_path):
    logged = run_keys(tiny_model_dir, tmp_path)
    doc = documented()
    assert sorted(k for k in logged if not matches(k, doc)) == []
    named = code_keys() | function_keys() | logged
    # a documented key that nothing produces is a ghost (a renamed metric, say)
    assert sorted(k for k in doc if not matches(k, named)) == []
    for key in ("reward/equal_reward_groups", "loss/kl", "is/weight_mean", f"eval/{ANY}/pass@{ANY}"):
        assert key in logged, key
