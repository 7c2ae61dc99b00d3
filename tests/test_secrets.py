"""An API key given to `tidal train` reaches the servers and nothing else: not config.json, not
any other file of the run, not the `tidal report` page, not the console. Driven as the probe did:
the real CLI in a subprocess, training against a `tidal serve` that requires the key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from test_cli_inputs import tidal_cli

from tidal.config import REDACTED
from tidal.convert import load_tokenizer
from tidal.server.options import ServerConfig

KEY = "sk-tidal-e2e-5f1c0a9e7b3d"


def test_a_key_on_the_command_line_reaches_the_server_and_no_file_or_page(tiny_model_dir, tmp_path):
    from tidal.adapters.async_engine import AsyncEngine
    from tidal.engine.llm_engine import LLMEngine
    from tidal.server.app import BackgroundServer, build_app

    core = LLMEngine(tiny_model_dir, load_tokenizer(tiny_model_dir), dtype="float32", kv_cache_tokens=4096)
    served = AsyncEngine(core)
    server = BackgroundServer(build_app(served, "tiny", ServerConfig(api_key=KEY))).start()
    try:
        with urllib.request.urlopen(server.url + "/get_weight_version", timeout=30) as r:
            raise AssertionError(f"the server answered without the key: {r.status}")
    except urllib.error.HTTPError as e:
        assert e.code == 401  # so a run that trains against it must have sent the key
    run = tmp_path / "run"
    try:
        train = tidal_cli(
            "train",
            f"--train.model={tiny_model_dir}",
            f"--train.output_dir={run}",
            "--train.num_steps=1",
            "--train.global_batch_size=4",
            "--train.micro_batch_size=4",
            "--train.dtype=float32",
            "--engine.dtype=float32",
            "--rollout.rollout_batch_size=2",
            "--rollout.n_samples_per_prompt=2",
            "--rollout.max_new_tokens=4",
            "--reward.fn=conftest:token_parity_reward",
            "--reward.workers=0",
            "--data.env_args={n: 8}",
            "--log.tensorboard=false",
            "--engine.kind=remote",
            f"--engine.urls=[{server.url}]",
            f"--engine.api_key={KEY}",
            cwd=tmp_path,
        )
        assert train.returncode == 0, train.stderr[-3000:]
        assert core.weight_version == 1  # the trained weights were pushed: an authorised call
    finally:
        server.stop()
        served.close()
    report = tidal_cli("report", str(run), cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]

    assert json.loads((run / "config.json").read_text())["engine"]["api_key"] == REDACTED
    assert "redacted" in (run / "report.html").read_text()
    files = [p for p in run.rglob("*") if p.is_file()]
    assert {"config.json", "report.html", "metrics.jsonl", "trainer_state.pt"} <= {p.name for p in files}
    holding = [str(p.relative_to(run)) for p in files if KEY.encode() in p.read_bytes()]
    assert holding == []
    for proc in (train, report):
        assert KEY not in proc.stdout and KEY not in proc.stderr
