"""Run model-written code in a separate, limited process.

Every call gets a fresh temporary working directory (deleted afterwards), a new session (its own
process group), a wall-clock deadline and these limits:

- CPU time (``RLIMIT_CPU``, soft limit = the timeout rounded up plus one second, a backstop for
  threads; SIGKILL one second later),
- address space (``RLIMIT_AS``, `memory_mb`), file size (``RLIMIT_FSIZE``), no core files,
- process count: a pids cgroup (v1) with ``pids.max`` when the machine lets us create one, else
  ``RLIMIT_NPROC`` (which the kernel does not enforce for root: see below),
- stdout and stderr: each kept up to `max_output_bytes`; a program that writes more is killed.

Everything the sandbox started is killed when the call returns, times out, or the awaiting task
is cancelled (a rollout deadline): the process group, every process in the cgroup, and with
bubblewrap the whole pid namespace. The direct child also gets SIGKILL if our process dies.

Backends (`SandboxConfig.backend`):

``bwrap``
    bubblewrap (Debian package ``bubblewrap``). The program runs with no capabilities in new
    network, pid, ipc and uts namespaces: no network at all (only its own loopback), it sees
    only its own processes, ``/`` is mounted read-only, ``/tmp`` is an empty private tmpfs and
    the working directory is the only writable host path. ``/root`` and ``/home`` are hidden
    (an empty tmpfs), except the interpreter's own install directories when they live there.
``rlimits``
    The fallback: only the limits above and the temporary directory. It does NOT isolate the
    network (the program can open sockets and connect anywhere the host can), the filesystem (it
    can read and write everything the caller's user can, anywhere), other processes (it can see
    them and signal those of the same user), or IPC. Use it only for trusted code or on a
    machine that is itself disposable.
``auto``
    bwrap when ``bwrap`` is on PATH and a one-time probe run works in this container, else
    rlimits with a warning logged once.

Process count as root: the kernel skips ``RLIMIT_NPROC`` for uid 0, so as root the limit comes
from a pids cgroup (``/sys/fs/cgroup/pids``, cgroup v1). Where that cannot be created (read-only
cgroupfs, cgroup v2 only), a root caller gets no process-count limit, and a warning says so once;
a non-root caller gets ``RLIMIT_NPROC``, which counts all of that user's processes, so it is set
to the user's current count plus `max_processes`. Both limits count threads as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import logging
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BACKENDS",
    "CODE_FILE",
    "STATUSES",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "arun_code",
    "available_backends",
    "resolve_backend",
    "run_code",
]

log = logging.getLogger("tidal.sandbox")

BACKENDS = ("auto", "bwrap", "rlimits")
STATUSES = ("ok", "error", "timeout", "memory", "output_limit")
# The program text is written to this file in the working directory; the default argv runs it.
CODE_FILE = "main.py"
WORKDIR_PREFIX = "tidal-sandbox-"
# bubblewrap's own processes inside the pids cgroup: the monitor and the namespace's init.
_BWRAP_PROCESSES = 2
# Where the bwrap backend mounts an empty tmpfs over home directories (secrets live there).
_HIDDEN_DIRS = ("/root", "/home")
_READ_CHUNK = 1 << 16
# After the program exits, how long a grandchild still holding its pipes may keep them open.
_PIPE_GRACE_S = 0.5
_MEMORY_ERROR_RE = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory")


class SandboxUnavailable(RuntimeError):
    """The requested backend cannot run on this machine."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and backend of one sandboxed run (see the module docstring for what each enforces).

    Attributes:
        backend: ``auto``, ``bwrap`` or ``rlimits``.
        timeout: wall-clock seconds before the whole sandbox is killed; the CPU-time limit is
            this rounded up to whole seconds.
        memory_mb: address-space limit of each process, in MiB.
        max_processes: processes (and threads) the program may have at once, itself included.
        max_output_bytes: bytes kept of stdout and of stderr each; more kills the program.
        max_file_mb: largest file the program may write, in MiB.
        tmp_root: directory in which the per-run working directories are created (None: the
            system temporary directory).
    """

    backend: str = "auto"
    timeout: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 32
    max_output_bytes: int = 1 << 16
    max_file_mb: int = 64
    tmp_root: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"sandbox backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not (isinstance(self.timeout, int | float) and 0 < self.timeout < math.inf):
            raise ValueError(f"sandbox timeout must be a positive number of seconds, got {self.timeout!r}")
        for name in ("memory_mb", "max_processes", "max_output_bytes", "max_file_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"sandbox {name} must be a positive integer, got {value!r}")


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        status: ``ok`` (exit code 0), ``error`` (non-zero exit or killed by a signal),
            ``timeout`` (wall clock or CPU time ran out), ``memory`` (non-zero exit with an
            out-of-memory message on stderr, e.g. Python's MemoryError) or ``output_limit``
            (stdout or stderr went past the limit; the program was killed).
        exit_code: the program's exit status; minus the signal number when a signal ended it;
            None when it was killed before its exit status was known.
        stdout: decoded stdout (UTF-8, bad bytes replaced), at most `max_output_bytes` bytes.
        stderr: decoded stderr, likewise.
        stdout_truncated: True when stdout was cut at the limit.
        stderr_truncated: True when stderr was cut at the limit.
        reason: one human-readable line, e.g. ``timed out after 5 s`` or ``exit code 1``.
        backend: ``bwrap`` or ``rlimits``, the backend that ran it.
        wall_time: seconds from start to the end of the run.
        workdir: the working directory it ran in (already deleted).
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    reason: str
    backend: str
    wall_time: float
    workdir: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------
# Backend detection


def _bwrap_argv(bwrap: str, workdir: str, argv: Sequence[str]) -> list[str]:
    """The bubblewrap command line that runs `argv` in `workdir` (see the module docstring)."""
    cmd = [bwrap, "--cap-drop", "ALL", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if os.geteuid() != 0:
        cmd.append("--unshare-user")  # an unprivileged bwrap needs a user namespace for the rest
    cmd += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for hidden in _HIDDEN_DIRS:
        if os.path.isdir(hidden):
            cmd += ["--tmpfs", hidden]
    # Bring back what the interpreter needs from under a hidden directory (pyenv in /root).
    for keep in _interpreter_dirs():
        cmd += ["--ro-bind", keep, keep]
    cmd += ["--bind", workdir, workdir, "--chdir", workdir, "--", *argv]
    return cmd


@functools.cache
def _interpreter_dirs() -> tuple[str, ...]:
    """Install directories of this Python that lie under a directory the bwrap backend hides."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    keep = set()
    for path in candidates:
        real = os.path.realpath(path)
        if any(real == h or real.startswith(h + os.sep) for h in _HIDDEN_DIRS) and os.path.isdir(real):
            keep.add(real)
            if os.path.basename(real) == "bin":
                keep.add(os.path.dirname(real))
    # Drop directories inside another kept one; a bind of the parent already carries them.
    return tuple(sorted(p for p in keep if not any(p != q and p.startswith(q + os.sep) for q in keep)))


_probe_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


@functools.cache
def _bwrap_problem() -> str | None:
    """None when bubblewrap works here, else why not. Probed once per process."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not on PATH (Debian/Ubuntu: apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix=WORKDIR_PREFIX) as workdir:
        argv = _bwrap_argv(bwrap, workdir, [sys.executable, "-I", "-c", "print('ok')"])
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap probe failed: {type(e).__name__}: {e}"
    if done.returncode != 0 or done.stdout.strip() != "ok":
        return f"bwrap probe failed with exit code {done.returncode}: {done.stderr.strip()[-300:]}"
    return None


def resolve_backend(backend: str = "auto") -> str:
    """The backend that will run: ``bwrap`` or ``rlimits``.

    ``auto`` picks bwrap when it works here, else rlimits (logging a warning once per process).

    Raises:
        SandboxUnavailable: ``bwrap`` was asked for and does not work on this machine.
        ValueError: an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"sandbox backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "rlimits":
        return "rlimits"
    with _probe_lock:
        problem = _bwrap_problem()
    if problem is None:
        return "bwrap"
    if backend == "bwrap":
        raise SandboxUnavailable(f"sandbox backend 'bwrap' is unavailable: {problem}")
    _warn_once(
        "fallback",
        f"sandbox: {problem}; falling back to rlimits only, which does NOT isolate the network, "
        "the filesystem or other processes (see tidal/rollout/sandbox.py)",
    )
    return "rlimits"


def available_backends() -> list[str]:
    """The concrete backends that work on this machine (``rlimits`` always does)."""
    with _probe_lock:
        return ["bwrap", "rlimits"] if _bwrap_problem() is None else ["rlimits"]


# ---------------------------------------------------------------------------------------------
# Process-count limit: a pids cgroup (v1)


@functools.cache
def _pids_cgroup_root() -> str | None:
    """The pids cgroup (v1) directory we may create children in, or None when there is none."""
    mount = None
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "cgroup" and "pids" in fields[3].split(","):
                mount = fields[1]
                break
    if mount is None:
        return None
    rel = "/"
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "pids" in controllers.split(","):
                rel = path
    root = os.path.join(mount, rel.lstrip("/"))
    _remove_stale_cgroups(root)
    probe = os.path.join(root, f"{WORKDIR_PREFIX}probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        with open(os.path.join(probe, "pids.max"), "w") as f:
            f.write("1")
        os.rmdir(probe)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(probe)
        return None
    return root


def _remove_stale_cgroups(root: str) -> None:
    """Remove the empty sandbox cgroups of processes that died before cleaning up (kill -9)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            owner = entry.name.removeprefix(WORKDIR_PREFIX).split("-")[0]
            if entry.name.startswith(WORKDIR_PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                with contextlib.suppress(OSError):  # not empty, or someone else's: leave it
                    os.rmdir(entry.path)


_cgroup_ids = itertools.count()


class _PidsCgroup:
    """A pids cgroup holding one sandbox: a hard limit on its processes and a way to kill them all."""

    def __init__(self, root: str, limit: int):
        self.path = os.path.join(root, f"{WORKDIR_PREFIX}{os.getpid()}-{next(_cgroup_ids)}")
        os.mkdir(self.path)
        with open(os.path.join(self.path, "pids.max"), "w") as f:
            f.write(str(limit))
        self.procs = os.path.join(self.path, "cgroup.procs")

    def pids(self) -> list[int]:
        with contextlib.suppress(OSError), open(self.procs) as f:
            return [int(p) for p in f.read().split()]
        return []

    def kill_all(self) -> None:
        # A process forking while we kill can add a pid after we read the list, so repeat until
        # empty; pids.max bounds how many such rounds there can be.
        for _ in range(100):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    async def remove(self) -> None:
        # rmdir fails with EBUSY until the killed processes have been reaped.
        for _ in range(200):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                self.kill_all()
                await asyncio.sleep(0.01)
        log.warning("sandbox: could not remove cgroup %s", self.path)


def _user_process_count() -> int:
    """How many processes (threads included) the current real uid runs, counted from /proc."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
    return count


# ---------------------------------------------------------------------------------------------
# Running


def _limits_preexec(cfg: SandboxConfig, nproc: int | None, cgroup_procs: str | None):
    """The function the child runs between fork and exec: join the cgroup, set the rlimits."""
    # a backstop one second past the wall-clock deadline: a single-threaded program's CPU time
    # never runs ahead of the wall clock, so the deadline fires first and the reason is stable
    cpu = math.ceil(cfg.timeout) + 1
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        if cgroup_procs is not None:
            with open(cgroup_procs, "w") as f:
                f.write(str(os.getpid()))
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the process that started us
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_mb << 20, cfg.memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.max_file_mb << 20, cfg.max_file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return preexec


def _classify(
    returncode: int | None, *, backend: str, timed_out: bool, overflow: bool, stderr: str, cfg: SandboxConfig
) -> tuple[str, int | None, str]:
    """(status, exit_code, reason) of a finished run. A pure function of what was observed."""
    exit_code = returncode
    # bubblewrap reports a signal-killed program as exit status 128 + the signal number.
    if backend == "bwrap" and returncode is not None and 128 < returncode < 128 + signal.NSIG:
        exit_code = -(returncode - 128)
    if timed_out:
        return "timeout", exit_code, f"timed out after {cfg.timeout:g} s"
    if overflow:
        return "output_limit", exit_code, f"output exceeded {cfg.max_output_bytes} bytes"
    if exit_code == -signal.SIGXCPU:
        return "timeout", exit_code, f"CPU time limit of {math.ceil(cfg.timeout) + 1} s exceeded"
    if exit_code == 0:
        return "ok", 0, "exit code 0"
    if exit_code is not None and exit_code > 0 and _MEMORY_ERROR_RE.search(stderr[-2000:]):
        return "memory", exit_code, f"memory limit of {cfg.memory_mb} MB exceeded"
    if exit_code is not None and exit_code < 0:
        return "error", exit_code, f"killed by {signal.Signals(-exit_code).name}"
    return "error", exit_code, f"exit code {exit_code}"


def _watch_exit(proc: asyncio.subprocess.Process) -> tuple[asyncio.Future, Callable[[], None]]:
    """A future done when `proc` exits (a pidfd on the event loop), and a function to stop watching."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:  # already exited and reaped
        exited.set_result(None)
        return exited, lambda: None
    except (AttributeError, OSError):  # no pidfd (old kernel): poll the returncode instead

        async def poll() -> None:
            while proc.returncode is None:
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(poll())
        return task, task.cancel

    def ready() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, ready)

    def unwatch() -> None:
        loop.remove_reader(fd)
        os.close(fd)

    return exited, unwatch


async def _returncode(proc: asyncio.subprocess.Process, limit_s: float = 5.0) -> int | None:
    """The exit status once asyncio's child watcher has reaped `proc` (it has exited or been killed)."""
    deadline = time.monotonic() + limit_s
    while proc.returncode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    return proc.returncode


def _sandbox_env(workdir: str) -> dict[str, str]:
    """A minimal environment: nothing of the caller's (API keys, proxies) leaks in."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _write_files(workdir: str, code: str, files: dict[str, str] | None) -> None:
    root = Path(workdir)
    (root / CODE_FILE).write_text(code, encoding="utf-8")
    for name, text in (files or {}).items():
        path = (root / name).resolve()
        if not path.is_relative_to(root.resolve()) or name == CODE_FILE:
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the workdir, not {CODE_FILE}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


async def arun_code(
    code: str,
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
    argv: Sequence[str] | None = None,
    config: SandboxConfig | None = None,
    **limits,
) -> SandboxResult:
    """Run `code` in a sandbox and return what happened; never leaves a process behind.

    Args:
        code: the program, written to ``main.py`` in a fresh working directory.
        stdin: text fed to the program's standard input (then closed).
        files: more files to create in the working directory, by relative path.
        argv: the command to run there; default ``[sys.executable, "-I", "main.py"]``.
        config: limits and backend; default ``SandboxConfig()``.
        **limits: overrides of `config` fields, e.g. ``timeout=2, memory_mb=256``.

    Raises:
        SandboxUnavailable: ``backend="bwrap"`` on a machine where bubblewrap does not work.
        ValueError: a bad limit or file name.

    Cancelling the awaiting task kills the sandbox and removes its directory before the
    CancelledError propagates.
    """
    cfg = dataclasses.replace(config or SandboxConfig(), **limits)
    if argv is None:
        argv = [sys.executable, "-I", CODE_FILE]
    if cfg.backend == "rlimits":
        backend = "rlimits"
    else:  # the first call probes bwrap by running it; keep that off the event loop
        backend = await asyncio.to_thread(resolve_backend, cfg.backend)

    cgroup_root = await asyncio.to_thread(_pids_cgroup_root)
    overhead = _BWRAP_PROCESSES if backend == "bwrap" else 0
    nproc = None
    if os.geteuid() != 0:
        nproc = _user_process_count() + cfg.max_processes + overhead
    elif cgroup_root is None:
        _warn_once("nproc", "sandbox: running as root without a pids cgroup; the process count is NOT limited")

    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=cfg.tmp_root)
    cgroup = proc = None
    tasks: list[asyncio.Future] = []
    try:
        _write_files(workdir, code, files)
        if cgroup_root is not None:
            cgroup = _PidsCgroup(cgroup_root, cfg.max_processes + overhead)
        cmd = _bwrap_argv(shutil.which("bwrap"), workdir, argv) if backend == "bwrap" else list(argv)
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=_sandbox_env(workdir),
            start_new_session=True,
            preexec_fn=_limits_preexec(cfg, nproc, cgroup.procs if cgroup else None),
        )
        overflow = False

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if cgroup is not None:
                cgroup.kill_all()

        async def feed() -> None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if stdin:
                    proc.stdin.write(stdin.encode())
                    await proc.stdin.drain()
                proc.stdin.close()

        async def pump(stream: asyncio.StreamReader) -> tuple[bytes, bool]:
            nonlocal overflow
            buf = bytearray()
            while chunk := await stream.read(_READ_CHUNK):
                room = cfg.max_output_bytes - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    overflow = True
                    kill()
                    return bytes(buf), True
            return bytes(buf), False

        readers = [asyncio.ensure_future(pump(proc.stdout)), asyncio.ensure_future(pump(proc.stderr))]
        feeder = asyncio.ensure_future(feed())
        tasks = [*readers, feeder]
        # Wait for the program itself to exit, not for its pipes to close: asyncio's
        # Process.wait() also waits for the pipes, which a forked child left behind holds open.
        exited, unwatch = _watch_exit(proc)
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(exited), cfg.timeout)
        except TimeoutError:
            timed_out = True
        finally:
            unwatch()
        kill()  # whatever the program left running dies with it
        # Output written just before exit is still in the pipes; a process that escaped the kill
        # (possible only in the rlimits fallback without a cgroup) could hold them, hence the bound.
        done, _ = await asyncio.wait(tasks, timeout=_PIPE_GRACE_S)
        (out, out_cut), (err, err_cut) = (
            r.result() if r in done and not r.cancelled() else (b"", False) for r in readers
        )
        returncode = await _returncode(proc)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        status, exit_code, reason = _classify(
            returncode, backend=backend, timed_out=timed_out, overflow=overflow, stderr=stderr, cfg=cfg
        )
        if overflow:
            exit_code = None  # we killed it; its own exit status was never reached
        return SandboxResult(
            status=status,
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            reason=reason,
            backend=backend,
            wall_time=time.monotonic() - start,
            workdir=workdir,
        )
    finally:
        # Runs on return, error and cancellation alike: kill everything, then clean up.
        for task in tasks:
            task.cancel()
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if cgroup is not None:
            cgroup.kill_all()
        shutil.rmtree(workdir, ignore_errors=True)
        if proc is not None:
            await asyncio.shield(_returncode(proc))
        if cgroup is not None:
            await cgroup.remove()


def run_code(
    code: str,
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
    argv: Sequence[str] | None = None,
    config: SandboxConfig | None = None,
    **limits,
) -> SandboxResult:
    """Synchronous `arun_code` for scripts and tests; not for use inside a running event loop."""
    return asyncio.run(arun_code(code, stdin=stdin, files=files, argv=argv, config=config, **limits))
