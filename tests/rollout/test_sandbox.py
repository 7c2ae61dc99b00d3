"""The code sandbox: each misbehaving program is stopped or refused, nothing is left behind, and
well-behaved programs running beside them still return the right output. Every test runs on
each backend that works here (CI installs bubblewrap); the rlimits fallback's documented gaps
(network, filesystem) are asserted as such."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from tidal.rollout import sandbox
from tidal.rollout.sandbox import (
    WORKDIR_PREFIX,
    SandboxConfig,
    SandboxUnavailable,
    _classify,
    arun_code,
    available_backends,
    resolve_backend,
    run_code,
)

BACKENDS = available_backends()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _marker() -> str:
    return f"tidal-test-{uuid.uuid4().hex}"


def _argv(marker: str) -> list[str]:
    # The marker rides in the command line, which forked children inherit: it finds leftovers.
    return [sys.executable, "-I", "main.py", marker]


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def _our_cgroups() -> list[str]:
    root = sandbox._pids_cgroup_root()
    if root is None:
        return []
    return [n for n in os.listdir(root) if n.startswith(f"{WORKDIR_PREFIX}{os.getpid()}-")]


def _assert_clean(result, marker: str) -> None:
    assert not os.path.exists(result.workdir)
    assert _processes_with(marker) == []
    assert _our_cgroups() == []


def test_ok_program_gets_stdin_files_and_a_private_workdir(backend):
    code = """
        import os, sys
        data = sys.stdin.read()
        print(data.upper(), end="")
        print(open("data/in.txt").read())
        open("out.txt", "w").write("x")
        print(sorted(os.listdir(".")), os.getcwd() == os.environ["HOME"], file=sys.stderr)
    """
    r = run_code(textwrap.dedent(code), stdin="hello\n", files={"data/in.txt": "42"}, backend=backend)
    assert (r.status, r.exit_code, r.reason, r.backend) == ("ok", 0, "exit code 0", backend)
    assert r.stdout == "HELLO\n42\n"
    assert r.stderr == "['data', 'main.py', 'out.txt'] True\n"
    assert not r.stdout_truncated and not r.stderr_truncated
    assert r.workdir.startswith(os.path.join(tempfile.gettempdir(), WORKDIR_PREFIX))
    assert not os.path.exists(r.workdir)


def test_nonzero_exit_and_signal_are_errors(backend):
    r = run_code("import sys; print('bye'); sys.exit(7)", backend=backend)
    assert (r.status, r.exit_code, r.reason, r.stdout) == ("error", 7, "exit code 7", "bye\n")
    r = run_code("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", backend=backend)
    assert (r.status, r.exit_code, r.reason) == ("error", -signal.SIGSEGV, "killed by SIGSEGV")


def test_infinite_loop_is_stopped(backend):
    marker = _marker()
    t0 = time.monotonic()
    r = run_code("while True: pass", argv=_argv(marker), timeout=1.0, backend=backend)
    assert (r.status, r.reason) == ("timeout", "timed out after 1 s")
    # the upper bounds only say it was stopped (not run for ever); generous for a loaded machine
    assert 1.0 <= r.wall_time < 30.0 and time.monotonic() - t0 < 60.0
    _assert_clean(r, marker)


def test_sleeping_program_is_stopped_by_the_wall_clock(backend):
    # No CPU used, so only the wall-clock deadline can end it.
    r = run_code("import time; time.sleep(600)", timeout=0.5, backend=backend)
    assert (r.status, r.reason) == ("timeout", "timed out after 0.5 s")
    assert 0.5 <= r.wall_time < 30.0  # stopped at its deadline, not after 600 s; generous under load


def test_memory_hog_is_refused(backend):
    r = run_code("x = bytearray(512 << 20)\nprint('allocated')", memory_mb=200, backend=backend)
    assert (r.status, r.exit_code, r.reason) == ("memory", 1, "memory limit of 200 MB exceeded")
    assert r.stdout == ""
    assert r.stderr.rstrip().endswith("MemoryError")
    # The same allocation fits under a larger limit: the limit, not the machine, refused it.
    r = run_code("x = bytearray(64 << 20)\nprint('allocated')", memory_mb=400, backend=backend)
    assert (r.status, r.stdout) == ("ok", "allocated\n")


def test_fork_bomb_is_refused_and_nothing_survives(backend):
    marker = _marker()
    code = """
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(600)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(n, e.errno)
            raise SystemExit(3)
    """
    r = run_code(textwrap.dedent(code), argv=_argv(marker), max_processes=8, timeout=10, backend=backend)
    assert (r.status, r.exit_code) == ("error", 3)
    forked, errno_ = map(int, r.stdout.split())
    assert errno_ == 11  # EAGAIN: the process limit refused the fork
    assert forked == 7  # 8 processes in all, the program itself included
    assert r.wall_time < 5.0  # the program ended; its sleeping children did not hold the run
    _assert_clean(r, marker)


def test_classic_fork_bomb_ends_and_leaves_nothing(backend):
    marker = _marker()
    r = run_code("import os\nwhile True: os.fork()", argv=_argv(marker), max_processes=16, timeout=3, backend=backend)
    assert r.status in {"error", "timeout"}
    assert "BlockingIOError" in r.stderr or r.status == "timeout"
    _assert_clean(r, marker)


def test_daemonised_child_is_killed_too(backend):
    """A child that leaves the process group (setsid) and closes its pipes is still killed: by
    the pid namespace (bwrap) or the pids cgroup (rlimits)."""
    if backend == "rlimits" and sandbox._pids_cgroup_root() is None:
        pytest.skip("rlimits without a pids cgroup cannot reach a process that left the group (documented)")
    marker = _marker()
    code = """
        import os, time
        if os.fork() == 0:
            os.setsid()
            os.close(1)
            os.close(2)
            time.sleep(600)
        print("parent done")
    """
    r = run_code(textwrap.dedent(code), argv=_argv(marker), backend=backend)
    assert (r.status, r.stdout) == ("ok", "parent done\n")
    assert r.wall_time < 3.0
    _assert_clean(r, marker)


def test_output_flood_is_cut_and_killed(backend):
    r = run_code("while True: print('x' * 999)", max_output_bytes=5000, timeout=10, backend=backend)
    assert (r.status, r.exit_code, r.reason) == ("output_limit", None, "output exceeded 5000 bytes")
    assert r.stdout == ("x" * 999 + "\n") * 5 and r.stdout_truncated and not r.stderr_truncated
    assert r.wall_time < 5.0


def test_output_within_limit_is_kept_whole(backend):
    r = run_code(
        "import sys; sys.stdout.write('y' * 4096); sys.stderr.write('e' * 100)", max_output_bytes=4096, backend=backend
    )
    assert (r.status, r.stdout, r.stderr) == ("ok", "y" * 4096, "e" * 100)
    assert not r.stdout_truncated


def test_socket_to_the_host(backend):
    """bwrap: a separate network namespace, so a server on the host's loopback is unreachable and
    so is the outside world. rlimits: no network isolation (documented); the connection works."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=3).sendall(b"hi")
            print("connected")
        except OSError as e:
            print("refused", e.errno)
    """
    try:
        r = run_code(textwrap.dedent(code), backend=backend, timeout=10)
    finally:
        server.close()
    assert r.status == "ok"
    if backend == "bwrap":
        assert r.stdout == "refused 111\n"  # ECONNREFUSED: its loopback is its own
    else:
        assert r.stdout == "connected\n"


@pytest.mark.skipif("bwrap" not in BACKENDS, reason="bubblewrap does not work on this machine")
def test_bwrap_has_no_route_outside():
    code = """
        import socket
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=3)
            print("connected")
        except OSError as e:
            print(e.errno)
    """
    r = run_code(textwrap.dedent(code), backend="bwrap")
    assert (r.status, r.stdout) == ("ok", "101\n")  # ENETUNREACH


def test_write_outside_the_workdir(backend):
    """bwrap: the host filesystem is read-only, so the write is refused and nothing appears.
    rlimits: no filesystem isolation (documented); the file is written."""
    outside = tempfile.mkdtemp(prefix="tidal-test-outside-", dir="/var/tmp")
    target = os.path.join(outside, "pwned.txt")
    code = f"""
        import errno
        try:
            open({target!r}, "w").write("x")
            print("written")
        except OSError as e:
            print(errno.errorcode[e.errno])
        open("inside.txt", "w").write("fine")
        print(open("inside.txt").read())
    """
    try:
        r = run_code(textwrap.dedent(code), backend=backend)
        assert r.status == "ok"
        if backend == "bwrap":
            assert r.stdout == "EROFS\nfine\n"
            assert not os.path.exists(target)
        else:
            assert r.stdout == "written\nfine\n"
            assert os.path.exists(target)
    finally:
        for name in os.listdir(outside):
            os.remove(os.path.join(outside, name))
        os.rmdir(outside)


@pytest.mark.skipif("bwrap" not in BACKENDS, reason="bubblewrap does not work on this machine")
def test_bwrap_sees_only_its_own_processes_and_no_home():
    code = """
        import os
        print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        print(os.listdir("/tmp"))
        print(sorted(os.listdir("/root")))
    """
    r = run_code(textwrap.dedent(code), backend="bwrap")
    assert r.status == "ok"
    pids, tmp, root = r.stdout.splitlines()
    # /root is an empty tmpfs but for the interpreter's install directory (pyenv keeps it there)
    kept = sorted({p.split("/")[2] for p in sandbox._interpreter_dirs() if p.startswith("/root/")})
    assert root == repr(kept)
    assert pids == "[1, 2]"  # bwrap's init and the program: no host process is visible
    assert tmp == "[]" or tmp.startswith("['tidal-sandbox-")  # private /tmp: only our workdir's mount point


def test_the_rollout_goes_on():
    """Misbehaving programs beside good ones, all at once: each is stopped or refused, the good
    ones return the right output, and nothing is left behind."""
    marker = _marker()
    bad = {
        "while True: pass": "timeout",
        "x = bytearray(1 << 30)": "memory",
        "import os\nwhile True: os.fork()": {"error", "timeout"},
        "while True: print('x' * 100)": "output_limit",
    }
    # 2 s where a timeout is an expected outcome; 30 s where the program must reach its own limit
    # first, which a loaded machine may take more than 2 s to start and do
    timeouts = {code: 2 if "timeout" in want else 30 for code, want in bad.items()}

    async def main():
        jobs = []
        for backend in BACKENDS:
            for code in bad:
                limits = {"timeout": timeouts[code], "memory_mb": 256, "max_processes": 8}
                jobs.append(arun_code(code, argv=_argv(marker), backend=backend, **limits))
            for k in range(3):
                jobs.append(arun_code(f"print(sum(range({k} * 1000)))", backend=backend))
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    per_backend = len(bad) + 3
    for b, backend in enumerate(BACKENDS):
        chunk = results[b * per_backend : (b + 1) * per_backend]
        for r, want in zip(chunk, bad.values(), strict=False):
            assert r.backend == backend
            assert r.status in ({want} if isinstance(want, str) else want), (r.status, r.reason)
        assert [(r.status, r.stdout) for r in chunk[len(bad) :]] == [
            ("ok", "0\n"),
            ("ok", f"{sum(range(1000))}\n"),
            ("ok", f"{sum(range(2000))}\n"),
        ]
    for r in results:
        assert not os.path.exists(r.workdir)
    assert _processes_with(marker) == [] and _our_cgroups() == []


def test_cancelling_the_caller_kills_the_sandbox(backend, tmp_path):
    """A rollout deadline cancels the awaiting task: the sandbox dies and its directory goes."""
    marker = _marker()

    async def main():
        task = asyncio.ensure_future(
            arun_code(
                "import os, time\nos.fork()\ntime.sleep(600)",
                argv=_argv(marker),
                timeout=600,
                backend=backend,
                tmp_root=str(tmp_path),
            )
        )
        deadline = time.monotonic() + 60
        while len(_processes_with(marker)) < 2 and time.monotonic() < deadline:  # until both processes run
            await asyncio.sleep(0.01)
        assert len(_processes_with(marker)) >= 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _processes_with(marker) == []
    assert list(tmp_path.iterdir()) == []
    assert _our_cgroups() == []


def test_rlimits_fallback_is_chosen_and_warned_about_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox, "_warned", set())
    sandbox._bwrap_problem.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tidal.sandbox"):
            assert resolve_backend("auto") == "rlimits"
            assert resolve_backend("auto") == "rlimits"
            r = run_code("print('fallback')", backend="auto")
        assert (r.status, r.stdout, r.backend) == ("ok", "fallback\n", "rlimits")
        warnings = [rec.getMessage() for rec in caplog.records if "falling back" in rec.getMessage()]
        assert len(warnings) == 1
        assert "bwrap is not on PATH" in warnings[0] and "does NOT isolate the network" in warnings[0]
        with pytest.raises(SandboxUnavailable, match="sandbox backend 'bwrap' is unavailable: bwrap is not on PATH"):
            resolve_backend("bwrap")
    finally:
        sandbox._bwrap_problem.cache_clear()


def test_config_is_validated():
    with pytest.raises(ValueError, match="backend must be one of auto, bwrap, rlimits, got 'docker'"):
        SandboxConfig(backend="docker")
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        SandboxConfig(timeout=0)
    with pytest.raises(ValueError, match="memory_mb must be a positive integer, got 1.5"):
        SandboxConfig(memory_mb=1.5)
    with pytest.raises(TypeError):
        run_code("print(1)", timeot=1)
    with pytest.raises(ValueError, match="must be a relative path inside the workdir"):
        run_code("print(1)", files={"../escape.txt": "x"}, backend="rlimits")


def test_classify():
    cfg = SandboxConfig(timeout=2.5, memory_mb=64, max_output_bytes=10)
    kw = dict(timed_out=False, overflow=False, stderr="", cfg=cfg)
    assert _classify(0, backend="rlimits", **kw) == ("ok", 0, "exit code 0")
    assert _classify(-signal.SIGXCPU, backend="rlimits", **kw) == ("timeout", -24, "CPU time limit of 4 s exceeded")
    assert _classify(128 + signal.SIGXCPU, backend="bwrap", **kw) == ("timeout", -24, "CPU time limit of 4 s exceeded")
    assert _classify(128 + 9, backend="rlimits", **kw) == ("error", 137, "exit code 137")
    assert _classify(128 + 9, backend="bwrap", **kw) == ("error", -9, "killed by SIGKILL")
    assert _classify(1, backend="rlimits", **{**kw, "stderr": "...\nMemoryError\n"}) == (
        "memory",
        1,
        "memory limit of 64 MB exceeded",
    )
    assert _classify(None, backend="bwrap", **{**kw, "timed_out": True}) == ("timeout", None, "timed out after 2.5 s")
    assert _classify(-9, backend="rlimits", **{**kw, "overflow": True}) == (
        "output_limit",
        -9,
        "output exceeded 10 bytes",
    )


@pytest.mark.skipif(sandbox._pids_cgroup_root() is None, reason="no writable pids cgroup on this machine")
def test_stale_cgroups_of_dead_processes_are_removed():
    root = sandbox._pids_cgroup_root()
    dead = _dead_pid()
    stale = os.path.join(root, f"{WORKDIR_PREFIX}{dead}-0")
    ours = os.path.join(root, f"{WORKDIR_PREFIX}{os.getpid()}-999999")
    os.mkdir(stale)
    os.mkdir(ours)
    try:
        sandbox._remove_stale_cgroups(root)
        assert not os.path.exists(stale)
        assert os.path.exists(ours)  # its owner is alive
    finally:
        for path in (stale, ours):
            if os.path.exists(path):
                os.rmdir(path)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
