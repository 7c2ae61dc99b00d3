"""HTTP clients for rollout servers: tidal's own (`tidal serve`) or SGLang's.

`EngineClient` talks to one server, `Router` spreads requests over several (least loaded first,
sticky per group so a group's shared prompt is reused from one server's prefix cache), and
`HttpEngine` is the `tidal.contracts.Engine` contract over a router: async and per request, its
connection pools living on the rollout's one event loop (`tidal.aio.LoopThread`).

Weights travel to `/update_weights_from_tensor` in tidal's own wire format (SGLang's endpoint of
that name takes in-process tensor handles instead, and SGLang servers take weights by
`distributed` or `disk`, so this format is for tidal servers only): the body is a safetensors
blob, `safetensors.torch.save({name: cpu_tensor, ...})`, sent as it is
(`Content-Type: application/octet-stream`), and the call's options are in the query string:

    POST /update_weights_from_tensor?weight_version=7&flush_cache=true&stage=false[&partial=true]

(`weight_version` left out: null, keep the version held; `partial`: delta pushes only;
`allow_older`: a trainer's first push after it restarted). A tidal server also takes the same
fields as a JSON body with the blob as base64 in `tensors`, for clients that can only send JSON;
that form adds about 0.6 s of one core per 32 MiB chunk (base64 and JSON, both ways), where
writing the blob takes 0.06 s: a push of SmolLM2 in fp32 takes 11 s as JSON, 1.9 s raw
(`python -m bench weight_push`).

A push is sent in several such requests (chunks) of at most `chunk_bytes` raw tensor bytes each:
all but the last are staged (`stage=true`, no version); the last carries the weight version,
asks for a cache flush and has the server load everything at once.

A tensor larger than `chunk_bytes` is split into pieces: runs of its flattened (row-major)
elements, each of at most `chunk_bytes` (`chunk_bytes // element_size` elements), that go into
chunks like any other tensor. A piece is a 1-D safetensors entry named

    NAME@OFFSET/SHAPE        e.g. model.embed_tokens.weight@7077888/49152x576

(OFFSET: its first element's index in the flattened tensor; SHAPE: the whole tensor's, joined
by x; the dtype is the entry's, the same for every piece). The server puts the pieces together
in its stage (`tidal.engine.weights.WeightStage`) and loads the tensor only when every element
arrived exactly once: a missing or overlapping piece is a 400 naming the tensor, and nothing of
the push is loaded. So no request carries more than `chunk_bytes` of tensors, whatever the
model: its body is at most `chunk_bytes` + the safetensors header (about 100 bytes a tensor),
which must fit the server's `tidal serve --max-weights-body-bytes` (64 MiB by default).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import uuid
from collections.abc import Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tidal.contracts import GenerationOutput, SamplingParams
from tidal.engine.weights import piece_name
from tidal.hardware import CPU

__all__ = [
    "EngineClient",
    "EngineError",
    "HttpEngine",
    "Router",
    "WEIGHTS_CONTENT_TYPE",
    "body_bytes",
    "decode_tensors",
    "encode_tensors",
    "is_engine_failure",
    "parse_generate_response",
    "sampling_params_to_dict",
    "weights_query",
]

log = logging.getLogger("tidal")
T = TypeVar("T")
# what `tidal serve` says it is (/get_model_info's "engine"): a trainer's cue for tidal's extensions
# (staged weight updates, weight checksums) that an SGLang server does not have
TIDAL_SERVER = "tidal"
DEFAULT_CHUNK_BYTES = 32 * 2**20  # a body of 32 MiB and its header: under tidal serve's 64 MiB for weight bodies
WEIGHTS_CONTENT_TYPE = "application/octet-stream"  # a weight chunk's body: the safetensors blob itself


class EngineError(RuntimeError):
    """A call to a rollout server failed; the message starts with the full URL of the endpoint."""

    def __init__(self, url: str, message: str, status: int | None = None, timed_out: bool = False) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.timed_out = timed_out  # no answer within the call's bound (the server may be stopped or stalled)


# ---------------------------------------------------------------------- wire format
def encode_tensors(
    named: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes]:
    """Yield safetensors blobs of at most `chunk_bytes` raw tensor bytes each, a tensor larger than
    that split into pieces (see the module docstring). Tensors are copied to CPU one chunk at a
    time."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        for key, part in _pieces(name, t.detach(), chunk_bytes):
            n = part.numel() * part.element_size()
            if chunk and size + n > chunk_bytes:
                yield st_save(chunk)
                chunk, size = {}, 0
            # A private contiguous CPU copy: safetensors refuses views and tensors sharing storage.
            chunk[key] = part.to(CPU, copy=True).contiguous()
            size += n
    if chunk:
        yield st_save(chunk)


def _pieces(name: str, t: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, t)` when `t` fits in a chunk, else its pieces by wire name: runs of its flattened
    elements of at most `chunk_bytes` each (one element where an element is larger)."""
    step = max(1, chunk_bytes // t.element_size())
    if t.numel() <= step:
        yield name, t
        return
    flat = t.reshape(-1)  # a view of a contiguous tensor; a strided one is copied once here
    for offset in range(0, flat.numel(), step):
        yield piece_name(name, offset, t.shape), flat[offset : offset + step]


def body_bytes(blob: bytes) -> int:
    """The bytes of the `/update_weights_from_tensor` body carrying `blob`: the blob itself."""
    return len(blob)


def decode_tensors(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of one `encode_tensors` chunk (pieces keep their wire names: the engine's stage puts
    them together)."""
    return list(st_load(blob).items())


def weights_query(
    version: int | None, flush_cache: bool, stage: bool, partial: bool = False, allow_older: bool = False
) -> dict[str, str]:
    """A weight chunk's options as `/update_weights_from_tensor`'s query string takes them (see the
    module docstring): no `weight_version` for None, the flags as `true` / `false`, the two rare
    ones only when set."""
    query = {} if version is None else {"weight_version": str(version)}
    flags = {"flush_cache": flush_cache, "stage": stage, "partial": partial, "allow_older": allow_older}
    query.update({k: "true" if v else "false" for k, v in flags.items() if v or k in ("flush_cache", "stage")})
    return query


def sampling_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for `params` (also accepted by tidal's server).

    SGLang spells "top-k off" as -1 and the seed as `sampling_seed`."""
    d: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
    }
    min_p = getattr(params, "min_p", 0.0)
    if min_p:
        d["min_p"] = min_p
    if params.stop:
        d["stop"] = list(params.stop)
    if params.stop_token_ids:
        d["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        d["sampling_seed"] = params.seed
    if params.ignore_eos:
        d["ignore_eos"] = True
    return d


def _as_version(value: Any, default: int = 0) -> int:
    """SGLang reports weight versions as strings; tidal as ints."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def encode_routing(routed: torch.Tensor) -> str:
    """An MoE request's routing as SGLang's `meta_info.routed_experts`: base64 of the int32
    expert ids, row-major over [positions, layers, top-k]."""
    return base64.b64encode(routed.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routing(text: str, rows: int) -> torch.Tensor:
    """`encode_routing`'s inverse as [rows, layers x top-k] (the shape's split is the model's);
    ValueError when the ids do not fill `rows` rows."""
    flat = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.int32)
    if rows < 1 or flat.numel() % rows:
        raise ValueError(f"meta_info.routed_experts: {flat.numel()} expert ids do not fill {rows} token rows")
    return flat.view(rows, -1)


def parse_generate_response(body: dict[str, Any], prompt_tokens: int | None = None) -> GenerationOutput:
    """A `GenerationOutput` from one SGLang-style /generate response object (`prompt_tokens`: the
    request's prompt length, which shapes its routing when the server returns one)."""
    meta = body.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
    logprobs = meta.get("output_token_logprobs") or []
    return GenerationOutput(
        token_ids=list(body.get("output_ids", [])),
        log_probs=[float(entry[0]) for entry in logprobs],
        finish_reason=reason,
        text=body.get("text", ""),
        weight_version=_as_version(meta.get("weight_version")),
        routed_experts=(
            decode_routing(meta["routed_experts"], prompt_tokens + len(body.get("output_ids", [])) - 1)
            if meta.get("routed_experts") and prompt_tokens is not None
            else None
        ),
    )


# ---------------------------------------------------------------------- one server
class EngineClient:
    """Async client for one server. Every call is bounded (overall, not per read): generation and
    weight loads by `timeout` seconds, the control calls (health, pause, resume, abort, flush,
    weight version) by `control_timeout`; any failure raises `EngineError` naming the URL of the
    endpoint.

    The underlying `httpx.AsyncClient` is made per event loop, so one client may be used from
    successive `asyncio.run` calls. At most `max_connections` requests are open at once; more
    wait (before their timeout starts) for a free connection.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        *,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
        control_timeout: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        # health, pause, resume, abort, flush, version: quick answers from a live server, so a
        # paused or silent one is found in seconds rather than after a generation's long bound
        self.control_timeout = min(control_timeout, timeout)
        self.max_connections = max_connections
        self._transport = transport
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    def _http(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=self.max_connections)
            # The overall deadline is enforced with asyncio.timeout in _request; httpx's own
            # timeouts are per operation and only a backstop here.
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, pool=None),
                limits=limits,
                transport=self._transport,
                headers=self.headers,
            )
            self._slots = asyncio.Semaphore(self.max_connections)
            self._loop = loop
        assert self._slots is not None
        return self._client, self._slots

    async def aclose(self) -> None:
        """Close the HTTP client of the running loop (a client of a finished loop is just dropped)."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._loop = self._slots = None

    async def _request(
        self, method: str, endpoint: str, json: Any = None, timeout: float | None = None, ok: tuple[int, ...] = ()
    ) -> Any:
        """Send one request; return the decoded JSON body (or the text, or None when empty)."""
        return (await self._send(method, endpoint, json, timeout, ok))[1]

    async def _send(
        self,
        method: str,
        endpoint: str,
        json: Any = None,
        timeout: float | None = None,
        ok: tuple[int, ...] = (),
        raw: tuple[bytes, dict[str, str]] | None = None,
    ) -> tuple[int, Any]:
        """Send one request; return (status, body). A status >= 400 not in `ok` raises EngineError.
        `raw`: (body, query) sent instead of `json`, the body as `WEIGHTS_CONTENT_TYPE`."""
        url = self.base_url + endpoint
        kw: dict[str, Any] = {"json": json}
        if raw is not None:
            kw = {"content": raw[0], "params": raw[1], "headers": {"content-type": WEIGHTS_CONTENT_TYPE}}
        limit = self.timeout if timeout is None else timeout
        client, slots = self._http()
        async with slots:
            try:
                async with asyncio.timeout(limit):
                    resp = await client.request(method, url, timeout=httpx.Timeout(limit, pool=None), **kw)
            except (TimeoutError, httpx.TimeoutException):
                raise EngineError(url, f"timed out after {limit:g} s", timed_out=True) from None
            except httpx.ConnectError as e:
                raise EngineError(url, f"cannot connect ({e or type(e).__name__})") from e
            except httpx.HTTPError as e:
                raise EngineError(url, f"{type(e).__name__}: {e}") from e
        try:
            body = resp.json() if resp.content else None
        except ValueError:
            body = resp.text
        if resp.status_code >= 400 and resp.status_code not in ok:
            detail = body.get("error") or body.get("message") or body if isinstance(body, dict) else body
            if isinstance(detail, dict):  # tidal's (and OpenAI's) shape: {"error": {"message": ...}}
                detail = detail.get("message", detail)
            raise EngineError(url, f"HTTP {resp.status_code}: {detail}", status=resp.status_code)
        return resp.status_code, body

    # --------------------------------------------------------------- generation
    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, rid: str | None = None, images: Sequence = ()
    ) -> GenerationOutput:
        """One response for `input_ids`, with the log-prob of every sampled token. `images`: a
        vision-language prompt's (`tidal.vision.Image`), sent as the files they were read from
        (`image_data`), which the server's processor reads again; the ids carry their placeholders."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params_to_dict(params),
            "return_logprob": True,
        }
        if images:
            payload["image_data"] = [image.data_uri() for image in images]
        if rid is not None:
            payload["rid"] = rid
        if params.return_routed_experts:
            payload["return_routed_experts"] = True
        body = await self._request("POST", "/generate", payload)
        if not isinstance(body, dict):
            raise EngineError(self.base_url + "/generate", f"unexpected response {body!r:.200}")
        try:
            return parse_generate_response(body, len(input_ids))
        except ValueError as e:
            raise EngineError(self.base_url + "/generate", str(e)) from e

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request, or all of them when `rid` is None."""
        body = {"rid": rid} if rid is not None else {"abort_all": True}
        await self._request("POST", "/abort_request", body, timeout=self.control_timeout)

    # --------------------------------------------------------------- control
    async def health(self) -> bool:
        """True when the server answers /health with 200; raises EngineError otherwise."""
        await self._request("GET", "/health", timeout=self.control_timeout)
        return True

    async def flush_cache(self) -> bool:
        """True when flushed; False when the server refused (SGLang refuses while requests run)."""
        status, body = await self._send("POST", "/flush_cache", timeout=self.control_timeout, ok=(400,))
        return status < 400 and not (isinstance(body, dict) and body.get("success") is False)

    async def pause(self) -> None:
        """Stop generating; unfinished requests wait and resume on `resume()` (SGLang's in_place mode)."""
        await self._request("POST", "/pause_generation", {"mode": "in_place"}, timeout=self.control_timeout)

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {}, timeout=self.control_timeout)

    async def get_weight_version(self) -> int:
        body = await self._request("GET", "/get_weight_version", timeout=self.control_timeout)
        return _as_version(body.get("weight_version") if isinstance(body, dict) else body)

    async def update_weights_from_disk(
        self, path: str | Path, version: int, timeout: float | None = None, allow_older: bool = False
    ) -> None:
        """Have the server load a model folder as `version` (`allow_older`: even if it holds a newer
        one, which a tidal server refuses otherwise: a trainer that restarted)."""
        # SGLang types weight_version as a string; tidal's server takes either.
        payload: dict[str, Any] = {"model_path": str(path), "weight_version": str(version)}
        if allow_older:
            payload["allow_older"] = True
        body = await self._request("POST", "/update_weights_from_disk", payload, timeout=timeout)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(self.base_url + "/update_weights_from_disk", str(body.get("message")))

    async def update_weights_from_tensors(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> None:
        """Send tensors in tidal's wire format (see the module docstring); tidal servers only. All
        chunks but the last are staged, so the server loads everything at once or nothing."""
        for blob, last in _with_last(encode_tensors(named, chunk_bytes)):
            await self.send_tensor_chunk(blob, version if last else None, flush_cache=last, timeout=timeout)

    async def send_tensor_chunk(
        self,
        blob: bytes,
        version: int | None,
        flush_cache: bool = True,
        timeout: float | None = None,
        partial: bool = False,
        allow_older: bool = False,
    ) -> None:
        """Post one encoded chunk: with `version` None it is staged, else it loads all staged
        chunks with it as that version (`partial`: they name only the tensors that changed;
        `allow_older`: the version may be older than the server's, as after a trainer restart)."""
        query = weights_query(version, flush_cache, version is None, partial, allow_older)
        endpoint = "/update_weights_from_tensor"
        body = (await self._send("POST", endpoint, timeout=timeout, raw=(blob, query)))[1]
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(self.base_url + endpoint, str(body.get("message")))

    async def get_weight_checksum(self, timeout: float | None = None) -> tuple[int, str]:
        """(weight version, CRC-32 of the loaded weights); tidal servers only."""
        body = await self._request("GET", "/get_weight_version?checksum=true", timeout=timeout)
        return _as_version(body.get("weight_version")), str(body.get("weight_checksum"))

    async def release_memory(self) -> None:
        """Free the server's KV cache and weights (SGLang: release_memory_occupation)."""
        await self._request("POST", "/release_memory_occupation", {})

    async def resume_memory(self) -> None:
        await self._request("POST", "/resume_memory_occupation", {})

    # --------------------------------------------------------------- server info, weights by broadcast
    # SGLang's bodies (see tidal.server.weight_group); `stage` is tidal's and is only sent when set.
    async def get_model_info(self) -> dict[str, Any]:
        body = await self._request("GET", "/get_model_info", timeout=self.control_timeout)
        return body if isinstance(body, dict) else {}

    async def get_server_info(self) -> dict[str, Any]:
        body = await self._request("GET", "/get_server_info", timeout=self.control_timeout)
        return body if isinstance(body, dict) else {}

    async def _weights_call(self, endpoint: str, payload: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        body = await self._request("POST", endpoint, payload, timeout=timeout)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(self.base_url + endpoint, str(body.get("message")))
        return body if isinstance(body, dict) else {}

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout: float | None = None,
    ) -> None:
        """Have the server join the trainer's weight group (answers once every rank has joined)."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._weights_call("/init_weights_update_group", payload, timeout)

    async def destroy_weights_update_group(self, group_name: str, timeout: float | None = None) -> None:
        await self._weights_call("/destroy_weights_update_group", {"group_name": group_name}, timeout)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: int | None = None,
        flush_cache: bool = True,
        stage: bool = False,
        timeout: float | None = None,
        allow_older: bool = False,
    ) -> None:
        """Announce tensors the trainer broadcasts on `group_name` (the caller broadcasts them while
        this waits); with `weight_version` the server reports that version once they are loaded
        (`allow_older`: even if it holds a newer one, as after a trainer restart; tidal's field)."""
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)  # SGLang types it as a string
        if stage:
            payload["stage"] = True
        if allow_older:
            payload["allow_older"] = True
        await self._weights_call("/update_weights_from_distributed", payload, timeout)


def _with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Yield (item, is_last) pairs, looking one item ahead."""
    it = iter(items)
    try:
        cur = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield cur, False
        cur = nxt
    yield cur, True


# ---------------------------------------------------------------------- several servers
def is_engine_failure(error: EngineError) -> bool:
    """True when `error` says the server is gone or broken (no connection, no answer in time, a
    5xx) rather than that the request was bad (a 4xx, which every server would refuse)."""
    return error.status is None or error.status >= 500


class Router:
    """Spreads requests over servers: each goes to the one with the fewest requests in flight
    (ties to the lowest index), except that requests sharing a `group` key follow the group's
    first request to its server until all of the group's requests have completed.

    A server that fails a request (see `is_engine_failure`) is marked down and gets no more
    requests; the request is sent again, unchanged (same prompt, same seed, so the same sample),
    to a live server. When none is left the request fails naming every server and its error.
    `mark_up` (or `replace`, for a restarted server at a new URL) puts one back in service."""

    def __init__(self, clients: Sequence[EngineClient]) -> None:
        if not clients:
            raise ValueError("Router needs at least one server")
        self.clients = list(clients)
        self.in_flight = [0] * len(self.clients)
        self.down: dict[int, str] = {}  # server index -> the error that took it out
        self.resent = 0  # requests sent again after their server failed
        self._groups: dict[Hashable, list[int]] = {}  # group -> [server index, requests in flight]

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self.down]

    def acquire(self, group: Hashable | None = None) -> int:
        """Choose a live server for one request and count it in flight; pair with `release`."""
        live = self.live
        if not live:
            errors = "; ".join(e for _, e in sorted(self.down.items()))  # each names its URL
            n = f"{len(self.down)} of {len(self.clients)}"
            raise EngineError("engines", f"no live engine left ({n} down): {errors}")
        entry = self._groups.get(group) if group is not None else None
        index = min(live, key=lambda i: self.in_flight[i])
        if entry is not None:
            if entry[0] in self.down:  # the group's server failed: the group moves, as a whole
                entry[0] = index
            entry[1] += 1
            index = entry[0]
        elif group is not None:
            self._groups[group] = [index, 1]
        self.in_flight[index] += 1
        return index

    def release(self, index: int, group: Hashable | None = None) -> None:
        self.in_flight[index] -= 1
        entry = self._groups.get(group) if group is not None else None
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self._groups[group]

    def mark_down(self, index: int, error: Exception) -> None:
        if index not in self.down:
            url = self.clients[index].base_url
            log.warning("engine %s failed, its requests go to the other engines: %s", url, error)
            self.down[index] = str(error)

    def mark_up(self, index: int) -> None:
        self.down.pop(index, None)

    def replace(self, index: int, client: EngineClient) -> None:
        """A new server (a restarted engine) in slot `index`, in service."""
        self.clients[index] = client
        self.mark_up(index)

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        group: Hashable | None = None,
        rid: str | None = None,
        images: Sequence = (),
    ) -> GenerationOutput:
        while True:
            index = self.acquire(group)
            try:
                return await self.clients[index].generate(input_ids, params, rid, images)
            except EngineError as e:
                if not is_engine_failure(e):
                    raise
                self.mark_down(index, e)
                self.resent += 1
            finally:
                self.release(index, group)

    async def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every live client concurrently (servers marked down are left out)."""
        clients = [self.clients[i] for i in self.live]
        return list(await asyncio.gather(*(getattr(c, method)(*args, **kwargs) for c in clients)))

    async def check_health(self) -> dict[int, str]:
        """Ask every server, down ones included, for /health (bounded by its control timeout);
        returns the error of each that did not answer, by index."""

        async def one(c: EngineClient) -> str | None:
            try:
                await c.health()
            except EngineError as e:
                return str(e)
            return None

        results = await asyncio.gather(*(one(c) for c in self.clients))
        return {i: e for i, e in enumerate(results) if e is not None}

    async def update_weights_from_tensors(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> None:
        """Encode each chunk once and post it to every server before encoding the next."""
        for blob, last in _with_last(encode_tensors(named, chunk_bytes)):
            await self.broadcast("send_tensor_chunk", blob, version if last else None, last, timeout)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


class HttpEngine:
    """The `tidal.contracts.Engine` contract over one or more HTTP servers (`tidal serve`, SGLang,
    Ray engine actors) behind a `Router`: each request goes to one server on its own, so requests
    join that server's running batch as they arrive.

    `weight_version` is the newest version a server reported (every response carries it; the
    weight sync checks each server's after a push). Control calls go to every server in service.
    Use it from one event loop (the rollout's): its HTTP clients belong to that loop."""

    def __init__(
        self,
        urls: str | Sequence[str],
        timeout: float = 600.0,
        *,
        max_connections: int = 256,
        api_key: str | None = None,
        control_urls: Sequence[str] | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        self.timeout = timeout
        self.api_key = api_key
        self.router = Router([EngineClient(u, timeout, max_connections=max_connections, api_key=api_key) for u in urls])
        # a front (sglang-router) that forwards /generate but not every control call: those go to
        # the servers behind it directly
        front = control_urls is not None and [u.rstrip("/") for u in control_urls] != [
            c.base_url for c in self.router.clients
        ]
        self.control = (
            Router([EngineClient(u, timeout, api_key=api_key) for u in control_urls]) if front else self.router
        )
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.control.clients]

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        group: Hashable | None = None,
        images: Sequence | None = None,
    ) -> GenerationOutput:
        """One response; a failed server is taken out of service and the request sent again,
        unchanged, to another (see `Router`). Cancelling the call aborts it on its server."""
        rid = request_id or uuid.uuid4().hex
        try:
            out = await self.router.generate(input_ids, sampling, group=group, rid=rid, images=images or ())
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # best effort: the server may be gone
                await asyncio.shield(self.abort(rid))
            raise
        self._version = max(self._version, out.weight_version)
        return out

    async def abort(self, request_id: str | None = None) -> None:
        await self.control.broadcast("abort", request_id)

    async def pause(self) -> None:
        """Every server stops generating; unfinished requests wait for `resume()`."""
        await self.control.broadcast("pause")

    async def resume(self) -> None:
        await self.control.broadcast("resume")

    async def sleep(self) -> None:
        await self.control.broadcast("release_memory")

    async def wake(self) -> None:
        await self.control.broadcast("resume_memory")

    async def flush_cache(self) -> bool:
        return all(await self.control.broadcast("flush_cache"))

    async def health(self) -> bool:
        return all(await self.control.broadcast("health"))

    async def check_health(self) -> dict[int, str]:
        """Errors of the servers that do not answer /health, by index (every server is asked)."""
        return await self.control.check_health()

    async def get_weight_versions(self) -> list[int]:
        return await self.control.broadcast("get_weight_version")

    async def get_stats(self) -> dict[str, float]:
        """Each numeric value of the servers' `/get_server_info`, summed over the servers in
        service that answer it (one that does not is left out here: the rollout or the next
        weight push finds it)."""
        clients = [self.control.clients[i] for i in self.control.live]
        infos = await asyncio.gather(*(c.get_server_info() for c in clients), return_exceptions=True)
        total: dict[str, float] = {}
        for info in infos:
            if isinstance(info, dict):
                for k, v in info.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        total[k] = total.get(k, 0) + v
        return total

    def note_version(self, version: int) -> None:
        """The weight sync confirmed every server at `version`."""
        self._version = version

    async def aclose(self) -> None:
        await self.router.aclose()
        if self.control is not self.router:
            await self.control.aclose()
