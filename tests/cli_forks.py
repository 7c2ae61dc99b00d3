"""Runs `python -m tidal.cli ARGS` many times from one process that has imported tidal (torch,
transformers) once: each run is a child forked from it, with its own working folder, stdout,
stderr and exit status, as if started from a shell, without importing torch again (seconds of a
loaded CPU per run). Started by `CliForks` (tests/test_cli_inputs.py), with the environment
`tidal_cli` gives a run.

Protocol, one JSON object per line: stdin gets {"args", "cwd", "stdout", "stderr"} (the last two
are files the run's output goes to); stdout answers {"returncode"} when that run has ended.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback


def _run_as_main(args: list[str]) -> int:
    """`python -m tidal.cli ARGS` in this (forked) process: its exit status, as the interpreter
    would give it (SystemExit's code; 1 and the traceback for any other exception)."""
    sys.argv = ["tidal", *args]
    try:
        runpy.run_module("tidal.cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _child(request: dict) -> None:
    code = 1
    try:
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),  # the server's requests are not the run's to read
            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            target = os.open(path, flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
        code = _run_as_main(request["args"])
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)  # never back into the server's loop


def main() -> None:
    # what every run imports (torch, transformers, the config, the loop); not tidal.cli itself,
    # which each run executes afresh as __main__, as `python -m` does
    import tidal.config  # noqa: F401
    import tidal.loop  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
