"""A weight push to a real `tidal serve` (a subprocess on 127.0.0.1, tiny model) that stops
answering on the weight route: the push ends within a bound that scales with the bytes sent
(`cluster.sync_base_timeout` + bytes / `cluster.sync_min_mb_per_s`), not after the whole
`cluster.sync_timeout`, and the error names the engine, the request, its bytes and the bound."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import loop_config, start_serve


class ServeProcess:
    """`tidal serve MODEL` in a process of its own; `stop()` / `cont()` send SIGSTOP / SIGCONT."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        args = [str(model_dir), "--host", "127.0.0.1", "--dtype", "float32", "--kv-cache-tokens", "512"]
        args += ["--max-num-seqs", "8"]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's tidal
        env.pop("TIDAL_API_KEY", None)
        self.log = log
        self.proc, self.url = start_serve(args, log, env)
        self.stopped = False

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tidal serve exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                httpx.get(self.url + "/health", timeout=5).raise_for_status()
                return
            except httpx.HTTPError as e:
                if time.monotonic() > deadline:
                    why = f"tidal serve at {self.url} did not answer /health in {timeout:g} s: {e}"
                    raise TimeoutError(why) from None
                time.sleep(0.5)

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def close(self) -> None:
        if self.stopped:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process does not act on SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)


@pytest.fixture
def serve(tiny_model_dir, tmp_path):
    server = ServeProcess(tiny_model_dir, tmp_path / "serve.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.close()


def remote_roles(model_dir, out_dir, url: str, transport: str):
    from transformers import AutoTokenizer

    import tidal.loop
    from tidal.roles import build_roles

    over = {
        "engine.kind": "remote",
        "engine.urls": [url],
        "cluster.weight_sync": transport,
        # the bound is small here (2 s + bytes at 1000 MB/s) and the sync timeout is long, so a
        # push that waits out the sync timeout instead (the stall this tests) fails its assertions
        "cluster.sync_base_timeout": 2,
        "cluster.sync_min_mb_per_s": 1000,
        "cluster.sync_timeout": 90,
    }
    cfg, _ = tidal.loop.resolve_precision(loop_config(model_dir, out_dir, **over))
    return build_roles(cfg, Path(model_dir), AutoTokenizer.from_pretrained(str(model_dir)), None)


@pytest.mark.parametrize(
    "transport,method,route",
    [
        ("http", "send_tensor_chunk", r"POST /update_weights_from_tensor \(chunk 1 of 1: [\d.]+ MB\)"),
        ("disk", "update_weights_from_disk", r"POST /update_weights_from_disk \(\S+weights_v2: [\d.]+ MB\)"),
    ],
)
def test_a_remote_engine_stopped_during_the_weight_push_is_named_within_the_byte_bound(
    serve, tiny_model_dir, tmp_path, monkeypatch, transport, method, route
):
    import re

    from tidal.adapters.client import EngineClient
    from tidal.sync.base import SyncError

    roles = remote_roles(tiny_model_dir, tmp_path / "run", serve.url, transport)
    try:
        # the engine is healthy when the push starts (its /health check passes), and stops when
        # the weights go out: SIGSTOP, as a paused or stalled server would
        send = getattr(EngineClient, method)

        async def stop_then_send(self, *args, **kwargs):
            serve.stop()
            return await send(self, *args, **kwargs)

        monkeypatch.setattr(EngineClient, method, stop_then_send)
        with pytest.raises(SyncError) as err:
            roles.sync.push(2)
        msg = str(err.value)
        assert msg.startswith(f"weight sync to engine {serve.url} (engine 0) over {transport}: "), msg
        assert re.search(route + r" got no answer within [\d.]+ s \(cluster.sync_base_timeout 2 s \+ ", msg), msg
        assert "at cluster.sync_min_mb_per_s 1000): the engine is stopped, stalled or slower than that" in msg
    finally:
        roles.close()
