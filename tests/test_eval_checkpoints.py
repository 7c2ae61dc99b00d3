"""`tidal eval` and `tidal serve` on what training writes: a run folder (its newest checkpoint),
a checkpoint of a full or a LoRA run (the adapter merged on load, as `tidal export` merges it),
with the run's own config under the command line's; one-line errors for anything else; a quiet
`tidal export`; the screenshot script on relative paths."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import hf_greedy, loop_config, start_serve
from transformers import AutoModelForCausalLM, AutoTokenizer

import tidal.loop
from tidal.cli import main
from tidal.config import build_config
from tidal.eval import eval_config, run_values
from tidal.model_source import ModelError, locate_model, model_folder
from tidal.train.checkpoint import export_checkpoint

REPO = Path(__file__).resolve().parents[1]
EVAL = {
    "eval.interval": 2,
    "eval.pass_k": [1, 2],
    "eval.datasets": [
        {"path": "env:arithmetic", "name": "arith", "n": 4, "env_args": {"n": 5, "seed": 7}},
        {"path": "env:arithmetic", "name": "greedy", "n": 1, "temperature": 0, "env_args": {"n": 3, "seed": 8}},
    ],
}
LORA = {"train.lora_rank": 4, "train.lora_alpha": 8.0, "train.lr": 1e-2}
TWO_STEPS = {"train.num_steps": 2, "train.save_interval": 2}
METRICS = ("mean_reward", "pass@1", "pass@2", "response_length", "truncated_ratio")


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """A 2-step LoRA run with eval sets: (run folder, metrics history)."""
    run = tmp_path_factory.mktemp("lora") / "run"
    history = tidal.loop.train(loop_config(tiny_model_dir, run, **LORA, **EVAL, **TWO_STEPS))
    return run, history


def _eval_json(tmp_path, model, *flags):
    out = tmp_path / "eval.json"
    assert main(["eval", str(model), "--out", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_eval_of_a_run_folder_scores_what_the_runs_own_eval_scored(tiny_model_dir, tmp_path, capsys):
    """No flag at all: the run's config.json gives the reward, eval sets, sampling and engine dtype,
    and the newest checkpoint's numbers are the loop's at that step, to the last digit."""
    run = tmp_path / "run"
    history = tidal.loop.train(loop_config(tiny_model_dir, run, **EVAL, **{**TWO_STEPS, "train.save_interval": 1}))
    result = _eval_json(tmp_path, run)
    assert result["model"] == str(run / "checkpoints" / "step_2") and result["step"] == 2
    assert list(result["datasets"]) == ["arith", "greedy"]
    for name, metrics in result["datasets"].items():
        for m in METRICS:
            if f"eval/{name}/{m}" in history[-1]:
                assert metrics[m] == history[-1][f"eval/{name}/{m}"], (name, m)
    assert "pass@2" not in result["datasets"]["greedy"]  # n = 1
    # an older checkpoint of the run: the loop's eval at its step (eval.interval 2: step 0's weights
    # are not saved, step 1 has no eval row), and flags go over the run's settings
    step_1 = _eval_json(tmp_path, run / "checkpoints" / "step_1", "--num-prompts", "2", "--k", "1")
    assert step_1["step"] == 1
    assert [(m["prompts"], m["samples"]) for m in step_1["datasets"].values()] == [(2, 8), (2, 2)]
    assert all("pass@2" not in m for m in step_1["datasets"].values())
    # the run's checkpoints/ folder is taken as the run
    assert _eval_json(tmp_path, run / "checkpoints")["datasets"] == result["datasets"]
    assert "arith" in capsys.readouterr().out


def test_a_config_file_and_flags_go_over_the_runs_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    cfg = build_config(
        None,
        {
            "reward.fn": "exact_match",
            "sampling.temperature": 0.7,
            "rollout.max_new_tokens": 48,
            "engine.api_key": "s3cret",
            "train.lr": 0.5,
            **EVAL,
        },
    )
    record = {**cfg.to_dict(), "resolved": {"cluster.device": {"requested": "auto", "device": "cpu"}}}
    record["cluster"]["device"] = "cpu"
    (run / "config.json").write_text(json.dumps(record))
    values = run_values(run / "config.json")
    assert "engine.api_key" not in values  # <redacted> in the file: read again from its file or $TIDAL_API_KEY
    assert values["cluster.device"] == "auto"  # as the run asked for it, resolved again on this machine
    assert not any(k.startswith(("train.", "log.", "debug.", "overlap.")) for k in values)
    got = eval_config(run / "config.json", None, {})
    for group in ("data", "rollout", "sampling", "reward", "eval", "agent", "tools"):
        assert getattr(got, group) == getattr(cfg, group), group
    over = tmp_path / "over.yaml"
    over.write_text("sampling: {temperature: 0.2}\nreward: {fn: math}\n")
    got = eval_config(run / "config.json", [str(over)], {"reward.fn": "exact_match", "eval.pass_k": [1]})
    assert (got.sampling.temperature, got.reward.fn, got.eval.pass_k) == (0.2, "exact_match", [1])
    assert got.rollout.max_new_tokens == 48  # the run's, under neither


def test_a_run_on_servers_is_evaluated_in_tidals_engine_unless_told_otherwise(tmp_path):
    cfg = build_config(None, {"engine.kind": "remote", "engine.urls": ["http://127.0.0.1:9"]})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    got = eval_config(tmp_path / "config.json", None, {})
    assert (got.engine.kind, got.engine.urls) == ("tidal", [])  # the servers hold their own weights
    kept = eval_config(tmp_path / "config.json", None, {"engine.urls": ["http://127.0.0.1:10"]})
    assert (kept.engine.kind, kept.engine.urls) == ("remote", ["http://127.0.0.1:10"])


def test_a_lora_checkpoint_is_merged_as_export_merges_it(lora_run, tmp_path):
    run, _ = lora_run
    source = locate_model(str(run))
    want = (run / "checkpoints" / "step_2", run, 2, True)
    assert (source.folder, source.run_dir, source.step, source.adapter) == want
    exported = export_checkpoint(run, tmp_path / "merged")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with model_folder(source) as folder:
        assert not list(folder.glob("adapter_*")) and not (folder / "state.json").exists()
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        tok = AutoTokenizer.from_pretrained(folder)  # the checkpoint's tokenizer, beside the merged weights
    assert not folder.exists()  # the temporary merged folder is gone with the block
    reference = AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
    assert tok.encode("12+3") == AutoTokenizer.from_pretrained(run / "checkpoints" / "step_2").encode("12+3")


def test_eval_of_a_lora_run_reproduces_the_loops_eval(lora_run, tmp_path):
    """The loop's engine gets `W + s · B A` from the trainer (`lora.merge_named`), `tidal eval`
    peft's merge of the saved adapter: the same sum in the same precision, so the same numbers."""
    run, history = lora_run
    result = _eval_json(tmp_path, run)
    assert result["step"] == 2
    for name, metrics in result["datasets"].items():
        for m in METRICS:
            if f"eval/{name}/{m}" in history[-1]:
                assert metrics[m] == history[-1][f"eval/{name}/{m}"], (name, m)


def _saved(tmp_path):
    """A run folder with a complete checkpoint at step 2 (no model in it: nothing is loaded)."""
    from tidal.train.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "run", 2, lambda folder: None, None, {}, {})
    return tmp_path / "run" / "checkpoints"


def _incomplete(tmp_path):
    folder = tmp_path / "run" / "checkpoints" / "step_3"
    folder.mkdir(parents=True)
    (folder / "trainer_state.pt").write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "nope", "no such file or folder; expected a run folder (train.output_dir), a checkpoint folder"),
        (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "a file, not a folder; expected a run folder"),
        (
            lambda p: (p / "a.txt").write_text("x") and p,
            "is not a model, checkpoint or run folder (it holds a.txt); expected a run folder",
        ),
        (
            lambda p: (p / "checkpoints").mkdir() or p,
            "a run folder with no complete checkpoint in {p}/checkpoints yet (the loop saves every "
            "train.save_interval steps and at the end)",
        ),
        (_incomplete, "an incomplete checkpoint (state.json and trainer_state.pt are written last"),
        (
            lambda p: _saved(p) / "step_7",
            "no such checkpoint; the complete checkpoints of run {p}/run are at steps 2 (or give the run folder",
        ),
    ],
    ids=["missing", "file", "not-a-model", "run-without-checkpoints", "incomplete-checkpoint", "step-not-saved"],
)
@pytest.mark.parametrize("command", ["eval", "serve"])
def test_what_is_not_a_model_is_one_line(command, make, message, tmp_path, capsys):
    model = make(tmp_path)
    assert main([command, str(model)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tidal {command}: model '{model}': ")
    assert message.format(p=tmp_path) in err
    assert err.count("\n") == 1  # one line, no traceback
    with pytest.raises(ModelError):
        locate_model(str(model))


def test_a_plain_model_folder_and_an_adapter_folder_are_taken_as_they_are(lora_run, tiny_model_dir, tmp_path):
    plain = locate_model(str(tiny_model_dir))
    assert (plain.folder, plain.run_dir, plain.step, plain.adapter) == (tiny_model_dir, None, None, False)
    with model_folder(plain) as folder:
        assert folder == tiny_model_dir  # nothing copied
    run, _ = lora_run
    adapter = export_checkpoint(run, tmp_path / "adapter", lora="adapter")
    source = locate_model(str(adapter))
    assert (source.run_dir, source.step, source.adapter) == (None, None, True)
    merged = export_checkpoint(run, tmp_path / "merged")
    ids = torch.tensor([[3, 4, 5]])
    with model_folder(source) as folder, torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    assert torch.equal(got, AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits)


def test_serve_loads_a_lora_run_and_leaves_no_merged_copy_behind(lora_run, tmp_path):
    """`tidal serve RUN` in a process of its own: it serves the newest checkpoint, merged, under the
    checkpoint's name, answers as the exported merged model does, and on SIGTERM removes the
    temporary merged folder."""
    run, _ = lora_run
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(run, tmp_path / "merged")).eval()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}
    env.pop("TIDAL_API_KEY", None)
    log = tmp_path / "serve.log"
    proc, url = start_serve([str(run), "--dtype", "float32"], log, env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "tidal serve did not answer /health"
            time.sleep(0.2)
        assert len(list(scratch.iterdir())) == 1  # the merged model, while it serves
        models = httpx.get(url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [str(run / "checkpoints" / "step_2")]
        prompt = [5, 6, 7, 8]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        answer = httpx.post(url + "/generate", json=body, timeout=60).json()
        with torch.no_grad():
            assert answer["output_ids"] == hf_greedy(merged, prompt, 6)
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 128 + 15  # SIGTERM, after uvicorn's graceful shutdown
    assert list(scratch.iterdir()) == []


def test_export_is_quiet(lora_run, tmp_path):
    """No library warning and no progress bar on a pipe: the output folder's path alone."""
    run, _ = lora_run
    out = tmp_path / "merged"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "export", str(run), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{out}\n"
    assert done.stderr == ""


def test_the_screenshot_script_takes_relative_paths(tmp_path):
    """Run from the folder that holds the run, with a stand-in for Chromium that checks the page
    it is handed and writes the PNG where it is told."""
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "chromium"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'for a in "$@"; do case $a in\n'
        "  --screenshot=*) shot=${a#--screenshot=};;\n"
        "  file://*) page=${a#file://};;\n"
        "esac; done\n"
        'grep -q "<svg" "$page" && printf PNG > "$shot"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "report_screenshot.sh"), "runs/x", "out.png"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{tmp_path / 'out.png'}\n"
    assert (tmp_path / "out.png").read_text() == "PNG"
