"""A weight push over HTTP (`cluster.weight_sync: http`) in tidal's two wire forms, side by side.

    python -m bench weight_push [--rounds 3] [--dtype float32]

A `tidal serve smollm2` subprocess (the engine as a remote rollout server runs it) takes full
pushes of SmolLM2's weights from this process through `HttpSync.push`, the trainer side's own
code: chunks of 32 MiB, all staged but the last, then the version and checksum checked. The two
forms of `/update_weights_from_tensor` (`tidal.adapters.client`) alternate push by push:

- `raw`: each chunk's safetensors blob is the body, its options in the query string (what tidal's
  trainer sends);
- `json`: the same blob as base64 in a JSON body, with the options beside it (the form tidal
  sent before; the server still takes it from clients that can only send JSON).

Each push's wall time is the trainer's wait: encoding, sending, the server's decoding, staging and
loading, and the checksum check. The first push of each form is not timed (connections, the
checksum's first pass). Results go to `bench/results/weight_push-<model>-<dtype>-<cpu kind>.json`.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from bench.common import machine, machine_kind, write_result
from tidal.server.app import listening_url

FORMS = ("json", "raw")


def start_server(dtype: str, log) -> tuple[subprocess.Popen, str]:
    """`tidal serve smollm2` on a free port, its output in the file `log`: (the process, its URL),
    returned once /health answers."""
    cmd = [sys.executable, "-m", "tidal.cli", "serve", "smollm2", "--dtype", dtype, "--port", "0"]
    cmd += ["--kv-cache-tokens", "2048"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    url = None
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read().decode(errors="replace")
        if proc.poll() is not None:
            sys.exit(f"tidal serve exited ({proc.returncode}):\n{text[-4000:]}")
        url = url or listening_url(text)
        try:
            if url and httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("tidal serve did not answer /health within 300 s")


def use_form(form: str, raw_send) -> None:
    """Make `EngineClient.send_tensor_chunk` send `form` (see the module docstring); `raw_send` is
    its own (the raw form)."""
    from tidal.adapters.client import EngineClient, EngineError

    if form == "raw":
        EngineClient.send_tensor_chunk = raw_send
        return

    async def send_json(self, blob, version, flush_cache=True, timeout=None, partial=False, allow_older=False) -> None:
        payload = {"tensors": base64.b64encode(blob).decode("ascii"), "weight_version": version}
        payload.update(flush_cache=flush_cache, stage=version is None, partial=partial, allow_older=allow_older)
        body = await self._request("POST", "/update_weights_from_tensor", payload, timeout=timeout)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(self.base_url + "/update_weights_from_tensor", str(body.get("message")))

    EngineClient.send_tensor_chunk = send_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="timed pushes of each form (default 3)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from tidal.adapters.client import EngineClient, encode_tensors
    from tidal.convert import ensure_model
    from tidal.sync.remote import HttpSync

    raw_send = EngineClient.send_tensor_chunk
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(ensure_model("smollm2"), dtype=dtype)

    class Trainer:  # the trainer role's `named_weights`, all this push needs
        def named_weights(self, dtype=None):
            for name, p in model.named_parameters():
                yield name, p.detach()

    named = list(Trainer().named_weights())
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    t0 = time.perf_counter()
    blobs = list(encode_tensors(named))
    encode_s = time.perf_counter() - t0
    b64_s = time.perf_counter()
    wire = {"raw": sum(map(len, blobs)), "json": sum(len(base64.b64encode(b)) for b in blobs)}
    b64_s = time.perf_counter() - b64_s
    del blobs

    log = tempfile.TemporaryFile()
    proc, url = start_server(args.dtype, log)
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    try:
        sync = HttpSync(Trainer(), [EngineClient(url, 600)], timeout=600)
        version = 0
        for r in range(args.rounds + 1):
            for form in FORMS if r % 2 == 0 else FORMS[::-1]:  # A B B A: neither form always goes first
                use_form(form, raw_send)
                version += 1
                t0 = time.perf_counter()
                sync.push(version)
                took = time.perf_counter() - t0
                if r > 0:
                    times[form].append(took)
                print(f"round {r} {form:>4}: {took:.2f} s{'' if r else ' (not timed)'}", flush=True)
        sync.close()
    finally:
        proc.terminate()
        proc.wait(30)

    med = {f: statistics.median(v) for f, v in times.items()}
    ratios = [j / r for j, r in zip(times["json"], times["raw"], strict=True)]
    print(f"\nSmolLM2 {args.dtype}, {model_bytes / 1e6:.0f} MB of weights, {len(named)} tensors, 2 processes")
    print(f"{'form':>5} | {'MB on the wire':>14} | {'push s (median)':>15} | pushes")
    for f in FORMS:
        print(f"{f:>5} | {wire[f] / 1e6:>14.0f} | {med[f]:>15.2f} | {', '.join(f'{t:.2f}' for t in times[f])}")
    print(f"json / raw, pair by pair: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"encoding the chunks alone: {encode_s:.2f} s (safetensors), base64 of them {b64_s:.2f} s")
    path = write_result(
        f"weight_push-smollm2-{args.dtype}",
        {
            "machine": machine(),
            "threads": os.environ.get("OMP_NUM_THREADS"),
            "model_bytes": model_bytes,
            "tensors": len(named),
            "wire_bytes": wire,
            "push_seconds": times,
            "push_seconds_median": med,
            "json_over_raw_pairs": ratios,
            "encode_seconds": encode_s,
            "base64_seconds": b64_s,
        },
        machine_kind(),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
