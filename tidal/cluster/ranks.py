"""Waiting on one call per trainer rank, and naming the rank that broke it.

When a rank dies (its process killed, out of memory) or stops (SIGSTOP, a debugger, a hung
machine), the ranks still running see only the collective it left: a gloo "Connection reset by
peer" or "Timed out waiting 300000ms for recv operation to complete" from deep inside FSDP2,
often before Ray reports the death itself, and a stopped process is never reported by Ray at all.
`wait_for_ranks` waits for every rank's result; once one fails it gives the others a grace period
to report (a death is often reported after the collective error it caused), then raises
`TrainerRankError` naming the rank that failed (dead, then stopped, then one that raised an error
of its own), its node and pid, and what the other ranks were waiting in.

A rank process on this node is looked up in /proc, which tells a stopped process from a running
one; on other nodes only what Ray reports is known.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

RANK_GRACE_S = 30.0  # after one rank fails, how long the others get to report why
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class TrainerRankError(RuntimeError):
    """A trainer rank died, stopped or failed during a call on every rank; the message names it (rank,
    node, pid) and says what the other ranks were waiting in. `rank` is the one named first."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def rank_name(rank: int, where: tuple[str, int] | None) -> str:
    """`trainer rank 1 (node 10.0.0.5, pid 1234)`, or `trainer rank 1` where that is not known yet."""
    return f"trainer rank {rank}" if where is None else f"trainer rank {rank} (node {where[0]}, pid {where[1]})"


def process_state(where: tuple[str, int] | None) -> str | None:
    """ "gone" or "stopped" for a rank process on this node (from /proc); None when it runs, or
    when it is on another node (not visible from here)."""
    from tidal.net import node_ip

    if where is None or where[0] != node_ip():
        return None
    try:
        stat = Path(f"/proc/{where[1]}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]  # the field after the command, which may hold spaces
    if state in ("T", "t"):
        return "stopped"
    if state in ("Z", "X"):
        return "gone"
    return None


def _waiting_in(error: BaseException) -> str | None:
    """Where a rank's error says it was waiting, when its innermost frame is a torch.distributed
    collective (it waited for a peer): `all_reduce (tidal/cluster/trainers.py:91 in _most)`."""
    # Ray's error reads as the rank's traceback (its `traceback_str` is not kept on what ray.get raises)
    frames = _FRAME.findall(getattr(error, "traceback_str", None) or str(error))
    if not frames:
        return None
    inner = [f for f in frames if "/torch/distributed/" in f[0] and f[2] not in ("wrapper", "wait")]
    if not inner or "/torch/distributed/" not in frames[-1][0]:
        return None  # its own error, not a collective's
    ours = [f for f in frames if "/tidal/" in f[0]]
    place = ""
    if ours:
        path, line, fn = ours[-1]
        place = f" ({'tidal/' + path.rsplit('/tidal/', 1)[1]}:{line} in {fn})"
    return f"{inner[-1][2]}{place}"


def actor_death(error: BaseException) -> str:
    """What Ray says ended a dead actor's process, in one line: `SYSTEM_ERROR: Worker unexpectedly
    exits with a connection error code 2` (killed: by SIGKILL, the kernel's OOM killer or a
    crash), `NODE_OUT_OF_MEMORY: Task was killed due to the node running low on memory`; "" when
    Ray's message has no exit type (its wording changed, or the error is not an actor's death)."""
    found = re.search(r"Worker exit type: (\S+) Worker exit detail: (.+?)(?:\.\s|\.?$)", str(error), re.S)
    return f"{found[1]}: {found[2].strip()}" if found else ""


def _reason(error: BaseException) -> str:
    """The first sentence of the error a rank raised, without gloo's source location."""
    cause = getattr(error, "cause", None) or error
    text = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # "[.../pair.cc:537] Read error ..."
    return text.split(". ", 1)[0]


def describe_failure(
    what: str,
    where: list[tuple[str, int] | None],
    errors: dict[int, BaseException],
    pending: list[int],
    collective_timeout: float | None = None,
) -> tuple[str, int]:
    """The message for a call on every rank (`what`) that did not complete, and the rank it names
    first. `errors`: the ranks that raised (Ray's actor-died error or the rank's own); `pending`:
    the ranks that had not answered when the wait ended."""
    import ray

    states = {r: process_state(where[r]) for r in pending}
    # a rank whose constructor raised is reported by Ray as a dead actor: it failed, with its error
    dead = [r for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError) and not e.actor_init_failed]
    dead += [r for r in pending if states[r] == "gone"]
    stopped = [r for r in pending if states[r] == "stopped"]
    waiting = {r: _waiting_in(e) for r, e in errors.items() if r not in dead}
    waiting = {r: w for r, w in waiting.items() if w is not None}
    own = [r for r in errors if r not in dead and r not in waiting]
    silent = [r for r in pending if states[r] is None]
    culprits: list[tuple[int, str]] = [(r, f"died during {what} ({_gone(errors.get(r))})") for r in sorted(dead)]
    culprits += [
        (r, f"stopped during {what} (its process is stopped: SIGSTOP, a debugger or job control)") for r in stopped
    ]
    culprits += [(r, f"failed during {what}: {_reason(errors[r])}") for r in sorted(own)]
    if not culprits and silent:  # the others waited for these, which never answered
        culprits = [(r, f"did not finish {what} (no answer: stopped, hung, or its node is lost)") for r in silent]
        silent = []
    if not culprits:  # every rank gave up in a collective: nothing tells which one was late
        first = min(waiting)
        culprits = [(first, f"gave up waiting in {waiting.pop(first)} during {what}: {_reason(errors[first])}")]
    named = {r for r, _ in culprits}
    parts = [f"{rank_name(r, where[r])} {text}" for r, text in culprits]
    subject = "it" if len(culprits) == 1 else "them"
    for r in sorted(waiting):
        if r not in named:
            parts.append(f"rank {r} was waiting for {subject} in {waiting[r]}: {_reason(errors[r])}")
    if any("Timed out" in _reason(errors[r]) for r in waiting) and collective_timeout is not None:
        parts.append(f"the trainers' collectives wait at most {collective_timeout:g} s (cluster.sync_timeout)")
    for r in silent:
        if r not in named:
            parts.append(f"rank {r} had not finished yet")
    return "; ".join(parts), culprits[0][0]


def _gone(error: BaseException | None) -> str:
    """`its process is gone`, and why where Ray said (`actor_death`)."""
    why = actor_death(error) if error is not None else ""
    return f"its process is gone; Ray: {why}" if why else "its process is gone"


def wait_for_ranks(
    refs: list,
    where: list[tuple[str, int] | None],
    what: str,
    timeout: float,
    collective_timeout: float | None = None,
    grace: float = RANK_GRACE_S,
) -> list[Any]:
    """The results of one call per rank (`refs` in rank order), within `timeout` seconds. When a rank
    fails, the others get `grace` seconds more to report (less when every rank still out is a
    process on this node that is gone or stopped); then `TrainerRankError` names the failed rank.
    When no rank fails and some are still out at `timeout`, TimeoutError names them."""
    import ray

    rank_of = {ref: r for r, ref in enumerate(refs)}
    errors: dict[int, BaseException] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout
    grace_end: float | None = None
    while pending:
        now = time.monotonic()
        if grace_end is not None:
            if now >= grace_end or all(process_state(where[rank_of[p]]) for p in pending):
                break
            wait = min(1.0, grace_end - now)  # polled: a rank on this node may stop or die meanwhile
        elif now >= deadline:
            break
        else:
            wait = deadline - now
        done, pending = ray.wait(pending, num_returns=1, timeout=wait)
        for ref in done:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                errors[rank_of[ref]] = e
                if grace_end is None:
                    grace_end = time.monotonic() + grace
    if not errors and not pending:
        return ray.get(refs)
    out = sorted(rank_of[p] for p in pending)
    if not errors:
        states = {r: process_state(where[r]) for r in out}
        if not any(states.values()):
            names = ", ".join(rank_name(r, where[r]) for r in out)
            raise TimeoutError(f"trainer ranks: {what} took longer than {timeout:g} s; not finished: {names}")
    message, rank = describe_failure(what, where, errors, out, collective_timeout)
    raise TrainerRankError(message, rank)
