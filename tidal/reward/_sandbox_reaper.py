"""The supervisor of one run of the sandbox's ``rlimits`` backend. Standard library only: it runs
as ``python -I -S _sandbox_reaper.py CPU_S AS_BYTES FSIZE_BYTES NPROC -- PROGRAM [ARGS...]``
(NPROC -1: no ``RLIMIT_NPROC``), not imported.

Without namespaces, a program that leaves its process group (``setsid``) or double-forks is out
of reach of a process-group kill: its orphans are re-parented to init. This supervisor marks
itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every orphan of the program is
re-parented to it instead and stays a descendant it can find. It starts the program under the
limits, then, when the program exits or the supervisor receives SIGTERM (the caller's deadline,
output limit or cancellation) or its parent dies (SIGTERM again, by ``PR_SET_PDEATHSIG``), it
SIGKILLs its children until it has none left, and only then ends: with the program's own exit
status (re-raising the signal that killed it), or by SIGKILL when it was told to stop.

What it cannot do: the program runs as the same user, so it can SIGKILL this supervisor; its
descendants then go to init and are out of reach (the caller still kills the process group and,
where one exists, the pids cgroup). The sandbox's documentation states this limit.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_EXEC_FAILED = 127  # as a shell reports a command it could not run


def _children() -> list[int]:
    """Pids of this process's children: the kernel's list, or a scan of /proc where it has none."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # a kernel built without CONFIG_PROC_CHILDREN
        pass
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def kill_all() -> None:
    """SIGKILL every descendant. Each round kills the children we have and reaps what has died;
    a killed child's own children are re-parented to us before its death can be reaped, so once
    no child is left (ECHILD) no descendant is either."""
    while True:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:  # none has died yet: a moment for the kills to land (never block on a survivor)
            time.sleep(0.002)


def _stop(signum: int, frame: object) -> None:
    kill_all()
    os.kill(os.getpid(), signal.SIGKILL)  # the caller sees the same status as a plain SIGKILL


def _exec_program(cpu: int, address_space: int, fsize: int, nproc: int, argv: list[str]) -> None:
    """In the forked child: limits on, default signal dispositions back, then the program."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the program dies with its supervisor
        # Python ignores these two; ignored dispositions would survive exec into the program.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        if nproc >= 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.execvp(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - whatever it was, the child must not return
        try:
            os.write(2, f"tidal sandbox: cannot run {argv[0]!r}: {e}\n".encode())
        finally:
            os._exit(_EXEC_FAILED)


def main(args: list[str]) -> None:
    cpu, address_space, fsize, nproc = (int(a) for a in args[:4])
    if args[4] != "--" or len(args) < 6:
        sys.exit("usage: _sandbox_reaper.py CPU_S AS_BYTES FSIZE_BYTES NPROC -- PROGRAM [ARGS...]")
    argv = args[5:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
        sys.exit(f"tidal sandbox: PR_SET_CHILD_SUBREAPER failed: {os.strerror(ctypes.get_errno())}")
    signal.signal(signal.SIGTERM, _stop)
    child = os.fork()
    if child == 0:
        _exec_program(cpu, address_space, fsize, nproc, argv)
    while True:  # reap re-parented orphans as they die; stop when the program itself has
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on we are ending anyway
    kill_all()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP cannot be handled, nor need resetting
            pass
        os.kill(os.getpid(), sig)  # end as the program did (core files are off: RLIMIT_CORE 0)
        os._exit(128 + sig)  # a signal whose default is not to terminate: report it as a shell would
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main(sys.argv[1:])
