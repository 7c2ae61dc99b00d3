"""Run model-written code in a separate, limited process.

Every call gets a fresh temporary working directory (deleted afterwards), a new session (its own
process group), a wall-clock deadline and these limits:

- CPU time (``RLIMIT_CPU``, soft limit = the timeout rounded up plus one second, a backstop for
  threads; SIGKILL one second later),
- address space (``RLIMIT_AS``, `memory_mb`), file size (``RLIMIT_FSIZE``, `max_file_mb`), no
  core files,
- process count: a pids cgroup (v1) with ``pids.max`` when the machine lets us create one, else
  ``RLIMIT_NPROC`` (which the kernel does not enforce for root: see below),
- stdout and stderr: each kept up to `max_output_bytes`; a program that writes more is killed.

Everything the sandbox started is killed when the call returns, times out, or the awaiting task
is cancelled (a rollout deadline); see each backend for how.

Backends (`SandboxConfig.backend`; None means the process default, ``$TIDAL_SANDBOX_BACKEND`` or
``auto``):

``bwrap``
    bubblewrap 0.5 or later (Debian package ``bubblewrap``). The program runs in new network,
    pid, ipc and uts namespaces with no capabilities and as an unprivileged user: uid/gid 65534
    (when the caller is root, a real switch to host uid 65534 by ``setpriv`` after bubblewrap
    has set up the mounts; otherwise a user namespace mapping the caller's own uid to 65534).
    It has no network at all (only its own loopback) and sees only its own processes. Its
    filesystem is built from nothing: read-only binds of ``/usr`` (and ``/bin``, ``/sbin``,
    ``/lib*``), a few ``/etc`` files the dynamic linker and libc read (``passwd`` and ``group``
    are written fresh, naming only root and nobody), and the interpreter's own install
    directories (``sys.prefix``, ``sys.base_prefix``, every symlink on the way to them, the
    shared libraries ``ldd`` names), wherever they live, ``/tmp`` included. Nothing else of the
    host is there: no ``/home``, ``/root``, ``/etc/shadow``, project checkout, ``/var``, ``/opt``
    or ``/sys``. ``/tmp`` is an empty tmpfs of `max_disk_mb`, and the working directory (at the
    same path as on the host) lies inside it, so all the program writes shares that cap (a
    working directory outside ``/tmp``, from `tmp_root`, gets a tmpfs of the same size of its
    own). The pid namespace ends with bubblewrap: nothing the program started survives it.
``rlimits``
    Only the limits above and the temporary directory, an explicit opt-in. It does NOT isolate
    the network (the program can open sockets and connect anywhere the host can), the
    filesystem (it can read and write everything the caller's user can, anywhere; only single
    files are capped), other processes (it can see them and signal those of the same user), or
    IPC. A supervisor (``_sandbox_reaper.py``, a child subreaper) keeps every descendant within
    reach, ``setsid`` and double forks included, and kills them all when the call ends; a
    program that kills the supervisor itself (it runs as the same user) can leave processes
    behind, which a pids cgroup, where there is one, still catches. Use it only for trusted
    code or on a machine that is itself disposable.
``auto``
    bwrap when ``bwrap`` is on PATH and a one-time probe run works in this process's setting.
    Otherwise it raises `SandboxUnavailable` saying why and how to opt in to ``rlimits``: the
    sandbox never falls back to no isolation on its own.

Process count as root: the kernel skips ``RLIMIT_NPROC`` for uid 0, so as root the limit comes
from a pids cgroup (``/sys/fs/cgroup/pids``, cgroup v1). Where that cannot be created (read-only
cgroupfs, cgroup v2 only), the bwrap backend limits uid 65534's processes with ``RLIMIT_NPROC``
(shared by the sandboxes running at once), and the rlimits backend running as root gets no
process-count limit (a warning says so once). A non-root caller gets ``RLIMIT_NPROC``, which
counts all of that user's processes, so it is set to the user's current count plus
`max_processes`. Both limits count threads as well.
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "CODE_FILE",
    "SANDBOX_UID",
    "STATUSES",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "arun_code",
    "available_backends",
    "default_backend",
    "resolve_backend",
    "run_code",
    "set_default_backend",
]

log = logging.getLogger("tidal.sandbox")

BACKENDS = ("auto", "bwrap", "rlimits")  # the config checks its field against the same names
# The process-wide default backend (SandboxConfig.backend None); child processes inherit it.
BACKEND_ENV = "TIDAL_SANDBOX_BACKEND"
STATUSES = ("ok", "error", "timeout", "memory", "disk", "output_limit")
# The program text is written to this file in the working directory; the default argv runs it.
CODE_FILE = "main.py"
WORKDIR_PREFIX = "tidal-sandbox-"
# The bwrap backend runs programs as "nobody": no file on a normal host belongs to it.
SANDBOX_UID = SANDBOX_GID = 65534
MIN_BWRAP_VERSION = (0, 5)  # --size (a capped tmpfs) and --perms appeared in 0.5.0
# bubblewrap's own processes inside the pids cgroup: the monitor and the namespace's init.
_BWRAP_PROCESSES = 2
# the rlimits backend's supervisor, likewise
_REAPER_PROCESSES = 1
_REAPER = str(Path(__file__).with_name("_sandbox_reaper.py"))
# How long the rlimits supervisor may take to kill the program's tree before we kill it instead.
_REAPER_GRACE_S = 5.0
# System directories shown read-only to the bwrap backend (a symlink, on merged-/usr systems, is
# re-created as one).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# /etc entries shown too: what the dynamic linker and libc read. No secrets live in these.
_ETC_PATHS = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/hosts",
)
# Written fresh into the sandbox's /etc: the host's names its users.
_ETC_PASSWD = (
    f"root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:{SANDBOX_UID}:{SANDBOX_GID}::/nonexistent:/usr/sbin/nologin\n"
)
_ETC_GROUP = f"root:x:0:\nnogroup:x:{SANDBOX_GID}:\n"
_READ_CHUNK = 1 << 16
# After the program exits, how long a grandchild still holding its pipes may keep them open.
_PIPE_GRACE_S = 0.5
_MEMORY_ERROR_RE = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory")
_NO_SPACE_RE = re.compile(r"No space left on device|Disk quota exceeded")
_FILE_TOO_LARGE_RE = re.compile(r"File too large")


class SandboxUnavailable(RuntimeError):
    """The requested backend cannot run on this machine."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and backend of one sandboxed run (see the module docstring for what each enforces).

    Attributes:
        backend: ``auto``, ``bwrap``, ``rlimits``, or None for the process default
            (`default_backend`: ``$TIDAL_SANDBOX_BACKEND``, else ``auto``), read at each call.
        timeout: wall-clock seconds before the whole sandbox is killed; the CPU-time limit is
            this rounded up to whole seconds.
        memory_mb: address-space limit of each process, in MiB.
        max_processes: processes (and threads) the program may have at once, itself included.
        max_output_bytes: bytes kept of stdout and of stderr each; more kills the program.
        max_file_mb: largest file the program may write, in MiB.
        max_disk_mb: bwrap: all the program may write (its ``/tmp`` and working directory, a
            RAM-backed tmpfs), in MiB. The rlimits backend has no such cap.
        tmp_root: directory in which the per-run working directories are created (None: the
            system temporary directory).
    """

    backend: str | None = None
    timeout: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 32
    max_output_bytes: int = 1 << 16
    max_file_mb: int = 64
    max_disk_mb: int = 128
    tmp_root: str | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"sandbox backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not (isinstance(self.timeout, int | float) and 0 < self.timeout < math.inf):
            raise ValueError(f"sandbox timeout must be a positive number of seconds, got {self.timeout!r}")
        for name in ("memory_mb", "max_processes", "max_output_bytes", "max_file_mb", "max_disk_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"sandbox {name} must be a positive integer, got {value!r}")


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        status: ``ok`` (exit code 0), ``error`` (non-zero exit or killed by a signal),
            ``timeout`` (wall clock or CPU time ran out), ``memory`` (non-zero exit with an
            out-of-memory message on stderr, e.g. Python's MemoryError), ``disk`` (the file-size
            limit or, with bwrap, the writable space ran out: SIGXFSZ, or a non-zero exit with
            "File too large" / "No space left on device" on stderr) or ``output_limit`` (stdout
            or stderr went past the limit; the program was killed).
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
# The bwrap backend's view of the host


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _expose(path: str, binds: set[str], links: dict[str, str], depth: int = 0) -> None:
    """Record what makes `path` resolve inside the sandbox as it does on the host: each symlink
    met on the way (re-created, its target followed the same way) and the real location at the
    end (bound read-only). A venv under /tmp or behind a symlinked folder thus works as is."""
    if depth > 40:  # a symlink loop; the probe run then reports that the interpreter fails
        return
    cur = "/"
    for part in Path(path).parts[1:]:
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt) and nxt not in links:
            target = os.readlink(nxt)
            links[nxt] = target
            _expose(os.path.join(cur, target), binds, links, depth + 1)
        cur = os.path.realpath(nxt)  # `cur` stays a real directory: '..' and links resolved
    if cur != "/" and os.path.exists(cur):
        binds.add(cur)


def _shared_libraries(executable: str) -> list[str]:
    """The shared libraries `executable` loads, as ``ldd`` lists them (none when ldd is missing)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    try:
        out = subprocess.run([ldd, executable], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [m for m in re.findall(r"(?:^|\s)(/\S+)", out) if os.path.exists(m)]


@dataclass(frozen=True)
class _Layout:
    """The read-only part of the bwrap backend's filesystem, the same for every call."""

    dirs: tuple[str, ...]  # created (mode 0755) to hold the binds and links below
    binds: tuple[str, ...]  # host paths bound read-only at the same path
    links: tuple[tuple[str, str], ...]  # (where, target): host symlinks re-created
    setpriv: str | None  # the tool that drops root to SANDBOX_UID (None: not root)

    def argv(self) -> list[str]:
        cmd: list[str] = []
        for d in self.dirs:
            cmd += ["--perms", "0755", "--dir", d]
        for b in self.binds:
            cmd += ["--ro-bind", b, b]
        for where, target in self.links:
            cmd += ["--symlink", target, where]
        return cmd


@functools.cache
def _layout() -> _Layout:
    """What the bwrap backend shows of the host: the system directories, a few /etc entries and
    this interpreter (see the module docstring)."""
    binds: set[str] = set()
    links: dict[str, str] = {}
    for path in (*_SYSTEM_PATHS, *_ETC_PATHS):
        if os.path.lexists(path):
            _expose(path, binds, links)
    interpreter = {sys.executable, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    for path in sorted(p for p in interpreter if p):
        _expose(os.path.abspath(path), binds, links)
    for lib in _shared_libraries(sys.executable):
        _expose(lib, binds, links)
    setpriv = None
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            _expose(setpriv, binds, links)
    # Nothing is bound twice: a path inside a bound one comes with it, as do links inside one.
    # /proc, /dev and /tmp are the sandbox's own, mounted separately (never the host's /tmp whole;
    # what lies under it is bound on top of the sandbox's).
    own = ("/proc", "/dev")
    kept = sorted(
        b
        for b in binds
        if b != "/tmp" and not any(b != o and _inside(b, o) for o in binds) and not any(_inside(b, o) for o in own)
    )
    kept_links = sorted(
        (w, t) for w, t in links.items() if not any(_inside(w, b) for b in kept) and not any(_inside(w, o) for o in own)
    )
    dirs = {"/etc"}
    for path in [*kept, *(w for w, _ in kept_links)]:
        parent = os.path.dirname(path)
        while parent not in ("/", "/tmp") and not any(_inside(parent, b) for b in kept):
            dirs.add(parent)
            parent = os.path.dirname(parent)
    return _Layout(
        dirs=tuple(sorted(dirs, key=lambda d: (d.count("/"), d))),
        binds=tuple(kept),
        links=tuple(kept_links),
        setpriv=setpriv,
    )


def _memfd(name: str, text: str) -> int:
    """A file descriptor of an in-memory file holding `text`, read from the start."""
    fd = os.memfd_create(name)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _bwrap_command(
    bwrap: str, workdir: str, names: Iterable[str], argv: Sequence[str], cfg: SandboxConfig
) -> tuple[list[str], list[int]]:
    """The bubblewrap command line that runs `argv` in `workdir` (see the module docstring), and
    the file descriptors it reads: the staged files `names` (relative to `workdir`), copied into
    the sandbox's tmpfs, and its /etc/passwd and /etc/group. The caller closes them."""
    layout = _layout()
    root = os.geteuid() == 0
    cmd = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    cmd += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if root:
        # bubblewrap keeps root for its set-up; setpriv then switches to SANDBOX_UID for good.
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    else:
        # an unprivileged bubblewrap needs a user namespace; the caller's uid shows as SANDBOX_UID
        cmd += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
    size = str(cfg.max_disk_mb << 20)
    # /tmp first: the interpreter's directories may lie under it and are bound on top.
    cmd += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    cmd += layout.argv()
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    fds: list[int] = []
    try:
        for name, text in (("passwd", _ETC_PASSWD), ("group", _ETC_GROUP)):
            fds.append(_memfd(name, text))
            cmd += ["--perms", "0644", "--file", str(fds[-1]), f"/etc/{name}"]
        if _inside(workdir, "/tmp"):  # inside the /tmp tmpfs, sharing its cap
            parent, parents = os.path.dirname(workdir), []
            while parent != "/tmp":
                parents.append(parent)
                parent = os.path.dirname(parent)
            for d in reversed(parents):
                cmd += ["--perms", "0755", "--dir", d]
            cmd += ["--perms", "0777", "--dir", workdir]
        else:
            cmd += ["--perms", "0777", "--size", size, "--tmpfs", workdir]
        made: set[Path] = set()
        for name in names:
            for parent in reversed(Path(name).parents[:-1]):
                if parent not in made:
                    made.add(parent)
                    cmd += ["--perms", "0777", "--dir", os.path.join(workdir, parent)]
            fds.append(os.open(os.path.join(workdir, name), os.O_RDONLY | os.O_CLOEXEC))
            cmd += ["--perms", "0666", "--file", str(fds[-1]), os.path.join(workdir, name)]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    cmd += ["--chdir", workdir, "--"]
    if root:
        cmd += [layout.setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_GID}", "--clear-groups"]
        cmd += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return [*cmd, *argv], fds


_probe_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _bwrap_version(bwrap: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


@functools.cache
def _bwrap_problem() -> str | None:
    """None when bubblewrap works here, else why not. Probed once per process, by running a
    program exactly as `arun_code` would."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not on PATH"
    version = _bwrap_version(bwrap)
    if version is None:
        return f"{bwrap} --version did not say which version it is"
    if version < MIN_BWRAP_VERSION:
        have, need = ".".join(map(str, version)), ".".join(map(str, MIN_BWRAP_VERSION))
        return f"bubblewrap {have} is too old: the size-limited /tmp needs {need} or later"
    if os.geteuid() == 0 and _layout().setpriv is None:
        return f"setpriv (util-linux) is not on PATH; as root it switches the program to uid {SANDBOX_UID}"
    with tempfile.TemporaryDirectory(prefix=WORKDIR_PREFIX) as workdir:
        Path(workdir, CODE_FILE).write_text("import os\nprint('ok', os.getuid())\n")
        argv, fds = _bwrap_command(bwrap, workdir, [CODE_FILE], [sys.executable, "-I", CODE_FILE], SandboxConfig())
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=60, pass_fds=fds, env=_sandbox_env(workdir)
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"the probe run failed: {type(e).__name__}: {e}"
        finally:
            for fd in fds:
                os.close(fd)
    if done.returncode != 0 or done.stdout.split() != ["ok", str(SANDBOX_UID)]:
        said = (done.stderr.strip() or done.stdout.strip())[-300:]
        return f"the probe run failed with exit code {done.returncode}: {said}"
    return None


_HOW_TO_OPT_OUT = (
    "install bubblewrap 0.5 or later (Debian/Ubuntu: apt-get install bubblewrap), or set sandbox.backend: rlimits "
    f"(environment: {BACKEND_ENV}=rlimits) to run model-written code WITHOUT isolation: it can then read and write "
    "what this user can, use the network and see other processes (docs/faults.md, 'The code sandbox')"
)


def default_backend() -> str:
    """The backend a `SandboxConfig` with ``backend=None`` asks for: ``$TIDAL_SANDBOX_BACKEND``
    (set by `set_default_backend`, or by hand), else ``auto``.

    Raises:
        ValueError: the environment variable names no backend.
    """
    value = os.environ.get(BACKEND_ENV, "") or "auto"
    if value not in BACKENDS:
        raise ValueError(f"${BACKEND_ENV} must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def set_default_backend(backend: str) -> None:
    """Make `backend` the process default (the config's ``sandbox.backend``). It is kept in
    ``$TIDAL_SANDBOX_BACKEND`` so that worker processes started afterwards use it too."""
    if backend not in BACKENDS:
        raise ValueError(f"sandbox backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    os.environ[BACKEND_ENV] = backend


def check_run(runs_code: bool, backend: str | None) -> None:
    """Before a run or an evaluation starts: where it executes model-written code (`runs_code`: the
    code_tests reward, the python tool; `tidal.config.Config.runs_model_code`) and would need
    bubblewrap (`backend` auto or bwrap, or None and the process default), raise ConfigError naming
    `sandbox.backend`, the reason and the opt-in to rlimits, rather than fail at the first reward
    call mid-run."""
    # this module runs on the standard library alone (a bare interpreter imports it), so the
    # config's error is imported only here
    from tidal.options import ConfigError

    if not runs_code:
        return
    try:
        resolve_backend(backend)
    except (SandboxUnavailable, ValueError) as e:
        raise ConfigError(f"invalid config:\n  sandbox.backend: {e}") from None


def resolve_backend(backend: str | None = None) -> str:
    """The backend that will run: ``bwrap`` or ``rlimits``.

    ``auto`` is bwrap, and never quietly anything else; ``rlimits`` runs only when asked for by
    name (a warning that it does not isolate is logged once per process); None is
    `default_backend`.

    Raises:
        SandboxUnavailable: ``auto`` or ``bwrap`` on a machine where bubblewrap does not work;
            the message says why and how to opt in to rlimits.
        ValueError: an unknown backend name.
    """
    if backend is None:
        backend = default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"sandbox backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "rlimits":
        _warn_once(
            "rlimits",
            "sandbox: backend rlimits: model-written code runs WITHOUT isolation (no filesystem, network or "
            "process separation); only its resource limits apply (docs/faults.md, 'The code sandbox')",
        )
        return "rlimits"
    with _probe_lock:
        problem = _bwrap_problem()
    if problem is None:
        return "bwrap"
    raise SandboxUnavailable(
        f"sandbox backend {backend!r} needs bubblewrap, which is not usable here: {problem}; {_HOW_TO_OPT_OUT}"
    )


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


def _user_process_count(uid: int) -> int:
    """How many processes (threads included) `uid` runs, counted from /proc."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
    return count


# ---------------------------------------------------------------------------------------------
# Running


def _cpu_limit(cfg: SandboxConfig) -> int:
    # a backstop one second past the wall-clock deadline: a single-threaded program's CPU time
    # never runs ahead of the wall clock, so the deadline fires first and the reason is stable
    return math.ceil(cfg.timeout) + 1


def _limits_preexec(cfg: SandboxConfig, nproc: int | None, cgroup_procs: str | None, backend: str):
    """The function the child runs between fork and exec: join the cgroup, set the rlimits.

    bwrap: the limits go on bubblewrap and are inherited by the program. rlimits: the child is
    the supervisor, which needs its memory and sets the program's limits itself; it only gets
    no core files, and SIGTERM (so that it kills the program's tree) when we die."""
    cpu = _cpu_limit(cfg)
    libc = ctypes.CDLL(None, use_errno=True)
    death_signal = signal.SIGKILL if backend == "bwrap" else signal.SIGTERM

    def preexec() -> None:
        if cgroup_procs is not None:
            with open(cgroup_procs, "w") as f:
                f.write(str(os.getpid()))
        libc.prctl(1, death_signal)  # PR_SET_PDEATHSIG: end with the process that started us
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if backend == "rlimits":
            return
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_mb << 20, cfg.memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.max_file_mb << 20, cfg.max_file_mb << 20))
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return preexec


def _reaper_argv(cfg: SandboxConfig, nproc: int | None, argv: Sequence[str]) -> list[str]:
    """The rlimits backend's command: the supervisor (see `_sandbox_reaper`) running `argv`."""
    limits = [_cpu_limit(cfg), cfg.memory_mb << 20, cfg.max_file_mb << 20, -1 if nproc is None else nproc]
    return [sys.executable, "-I", "-S", _REAPER, *map(str, limits), "--", *argv]


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
        return "timeout", exit_code, f"CPU time limit of {_cpu_limit(cfg)} s exceeded"
    if exit_code == 0:
        return "ok", 0, "exit code 0"
    tail = stderr[-2000:]
    file_limit = f"file size limit of {cfg.max_file_mb} MB exceeded"
    if exit_code == -signal.SIGXFSZ:
        return "disk", exit_code, file_limit
    if exit_code is not None and exit_code > 0:
        if _MEMORY_ERROR_RE.search(tail):
            return "memory", exit_code, f"memory limit of {cfg.memory_mb} MB exceeded"
        if _FILE_TOO_LARGE_RE.search(tail):
            return "disk", exit_code, file_limit
        if _NO_SPACE_RE.search(tail):
            # under rlimits it is the host's own disk that filled up, not a sandbox limit
            cap = f"writable space of {cfg.max_disk_mb} MB" if backend == "bwrap" else "the disk"
            return "disk", exit_code, f"no space left: {cap} exceeded"
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


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(_READ_CHUNK):
        pass


def _write_files(workdir: str, code: str | None, files: dict[str, str] | None) -> list[str]:
    """Write the program (unless None) and `files` into `workdir`; their paths relative to it."""
    root = Path(workdir).resolve()
    names = []
    if code is not None:
        (root / CODE_FILE).write_text(code, encoding="utf-8")
        names.append(CODE_FILE)
    for name, text in (files or {}).items():
        path = (root / name).resolve()
        if not path.is_relative_to(root) or path == root / CODE_FILE:
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the workdir, not {CODE_FILE}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        names.append(str(path.relative_to(root)))
    return names


class _Run:
    """The processes of one call and how to end them all."""

    def __init__(self, proc: asyncio.subprocess.Process, backend: str, cgroup: _PidsCgroup | None):
        self.proc, self.backend, self.cgroup = proc, backend, cgroup
        # A pidfd names this process even after it is reaped (no pid reuse), and signalling
        # through it never reaps: Process.send_signal polls, and so can steal the exit status
        # from asyncio's child watcher.
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def kill(self) -> None:
        """Start killing everything (no waiting): safe from a callback, repeatable."""
        if self.backend == "rlimits":
            # Only the supervisor can reach the children that left the process group; a SIGKILL
            # to it (or to its group) would orphan them to init instead.
            with contextlib.suppress(ProcessLookupError):
                if self.pidfd is not None:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGTERM)
                elif self.proc.returncode is None:
                    os.kill(self.proc.pid, signal.SIGTERM)
            return
        self._kill_hard()

    def _kill_hard(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.cgroup is not None:
            self.cgroup.kill_all()

    async def end(self) -> None:
        """Kill everything and wait (bounded) until the direct child is reaped."""
        if self.proc.returncode is None:
            self.kill()
            if self.backend == "rlimits":
                await _returncode(self.proc, _REAPER_GRACE_S)
        # the backstop: the group and the cgroup, whatever the supervisor managed
        self._kill_hard()
        await _returncode(self.proc)


async def arun_code(
    code: str | None,
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
    argv: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    config: SandboxConfig | None = None,
    **limits,
) -> SandboxResult:
    """Run `code` in a sandbox and return what happened; never leaves a process behind.

    Args:
        code: the program, written to ``main.py`` in a fresh working directory; None writes
            none (`argv` then names what runs).
        stdin: text fed to the program's standard input (then closed).
        files: more files to create in the working directory, by relative path.
        argv: the command to run there; default ``[sys.executable, "-I", "main.py"]``. With
            bwrap it must live in the directories the sandbox shows (``/usr``, the interpreter's).
        env: environment variables set over the minimal environment the program gets (``PATH``,
            ``HOME`` and ``TMPDIR`` = the working directory, ``LANG``); nothing else of the
            caller's environment is passed.
        config: limits and backend; default ``SandboxConfig()``.
        **limits: overrides of `config` fields, e.g. ``timeout=2, memory_mb=256``.

    Raises:
        SandboxUnavailable: the backend is ``auto`` or ``bwrap`` and bubblewrap does not work
            on this machine (the message says how to opt in to ``rlimits``).
        ValueError: a bad limit or file name.

    Cancelling the awaiting task kills the sandbox and removes its directory before the
    CancelledError propagates.
    """
    cfg = dataclasses.replace(config or SandboxConfig(), **limits)
    if argv is None:
        if code is None:
            raise ValueError("arun_code: code None needs an argv to run")
        argv = [sys.executable, "-I", CODE_FILE]
    requested = cfg.backend if cfg.backend is not None else default_backend()
    if requested == "rlimits":
        backend = resolve_backend("rlimits")
    else:  # the first call probes bwrap by running it; keep that off the event loop
        backend = await asyncio.to_thread(resolve_backend, requested)

    cgroup_root = await asyncio.to_thread(_pids_cgroup_root)
    overhead = _BWRAP_PROCESSES if backend == "bwrap" else _REAPER_PROCESSES
    nproc = None
    if os.geteuid() != 0:
        nproc = _user_process_count(os.getuid()) + cfg.max_processes + overhead
    elif cgroup_root is None and backend == "bwrap":
        # the program runs as SANDBOX_UID, so RLIMIT_NPROC holds; it counts all of that uid's
        # processes, those of other sandboxes running now included
        nproc = _user_process_count(SANDBOX_UID) + cfg.max_processes
    elif cgroup_root is None:
        _warn_once("nproc", "sandbox: rlimits as root without a pids cgroup; the process count is NOT limited")

    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=cfg.tmp_root)
    cgroup = run = None
    fds: list[int] = []
    tasks: list[asyncio.Future] = []
    try:
        names = _write_files(workdir, code, files)
        if cgroup_root is not None:
            cgroup = _PidsCgroup(cgroup_root, cfg.max_processes + overhead)
        if backend == "bwrap":
            cmd, fds = _bwrap_command(shutil.which("bwrap"), workdir, names, argv, cfg)
        else:
            cmd = _reaper_argv(cfg, nproc, argv)
        spawn = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env={**_sandbox_env(workdir), **(env or {})},
                start_new_session=True,
                pass_fds=fds,
                preexec_fn=_limits_preexec(cfg, nproc, cgroup.procs if cgroup else None, backend),
            )
        )
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            # Cancelled while asyncio connects the pipes: let that finish (milliseconds) so that
            # what it started is ours to kill below. Cancelled inside it, asyncio would SIGKILL
            # only the direct child and then wait for every pipe to close, which a surviving
            # grandchild keeps open for as long as it runs.
            run = _Run(await spawn, backend, cgroup)
            raise
        run = _Run(proc, backend, cgroup)
        for fd in fds:  # bubblewrap has its copies; it reads them while setting up
            os.close(fd)
        fds = []
        overflow = False

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
                    run.kill()
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
        await run.end()  # whatever the program left running dies with it
        # Output written just before exit is still in the pipes; a process that escaped the kill
        # (possible only under rlimits, see the module docstring) could hold them, hence the bound.
        done, _ = await asyncio.wait(tasks, timeout=_PIPE_GRACE_S)
        (out, out_cut), (err, err_cut) = (
            r.result() if r in done and not r.cancelled() else (b"", False) for r in readers
        )
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        status, exit_code, reason = _classify(
            proc.returncode, backend=backend, timed_out=timed_out, overflow=overflow, stderr=stderr, cfg=cfg
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
        for fd in fds:
            os.close(fd)
        if run is not None:
            if run.proc.returncode is None:
                await asyncio.shield(run.end())
            run.close()
            # Read what is left, to the end of file now that every writer is dead: a pipe left
            # unread (an output flood, a cancelled reader) would keep asyncio's transport open
            # past the event loop's life.
            drains = [asyncio.ensure_future(_drain(s)) for s in (run.proc.stdout, run.proc.stderr)]
            await asyncio.wait(drains, timeout=_PIPE_GRACE_S)
            for task in drains:
                task.cancel()
        if cgroup is not None:
            cgroup.kill_all()
        shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None:
            await cgroup.remove()


def run_code(
    code: str | None,
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
    argv: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    config: SandboxConfig | None = None,
    **limits,
) -> SandboxResult:
    """Synchronous `arun_code` for scripts and tests; not for use inside a running event loop."""
    return asyncio.run(arun_code(code, stdin=stdin, files=files, argv=argv, env=env, config=config, **limits))
