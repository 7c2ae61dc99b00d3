"""Agent programs: `agent.command`, an unmodified agent run as its own process once per sample,
talking to the sample's session on the agent door.

The agent is any program that speaks an OpenAI- or Anthropic-compatible API and reads its
endpoint from the environment, as their client packages do: tidal starts it with
`OPENAI_BASE_URL` / `OPENAI_API_KEY` (the session's URL, ending in `/v1`, and its token) and
`ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY` (the same session without `/v1`, as the `anthropic`
package wants it). Every call it makes is recorded by the door's `Session`, exactly as the calls
of `agent.fn` are: the samples, `agent.samples`, the response budget and the alignment rule are
the door's, not this module's.

The prompt reaches the program three ways, so that it needs no change to read it: the
environment variable `TIDAL_PROMPT`, its standard input, and `{prompt}` in an argument of the
command. A prompt given as chat messages is passed as their JSON. The label never reaches it.

It runs under the code sandbox's `rlimits` backend (`tidal.reward.sandbox`): a fresh working
directory, removed afterwards; its own session and process group under a supervisor that kills
every process it started (double forks included) when it exits, times out (`agent.timeout`), or
the rollout is cancelled; an address-space limit (`agent.memory_mb`), a CPU-time backstop, capped
file size, stdout and stderr each kept up to `MAX_OUTPUT_BYTES` (more kills it). Not bubblewrap:
its new network namespace would cut the program off from the door on the host's 127.0.0.1. The
program gets a minimal environment: `program_path()`, `HOME` and `TMPDIR` set to its working
directory, the variables above, `OPENAI_AGENTS_DISABLE_TRACING=1` (the OpenAI Agents SDK would
otherwise export traces to api.openai.com) and `agent.env`; none of tidal's other variables (a
real API key, a proxy) leak in.

What it printed on stdout and its exit status go to the samples' metadata (`agent_output`,
`agent_exit_code`) for `reward.fn` to score. A program that exits non-zero, is killed, or runs
past its time fails its sample with the tail of its stderr, whatever calls it made: a trajectory
the agent did not finish is not one to reward. The exception is the door's own: a program that
stops because the door refused a call on the spent response budget keeps its samples (truncated),
as `agent.fn` does.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from typing import TYPE_CHECKING

from tidal.reward.sandbox import SandboxConfig, arun_code

if TYPE_CHECKING:
    from tidal.rollout.agent import Session
    from tidal.rollout.options import AgentConfig

PROMPT_ENV = "TIDAL_PROMPT"
PROMPT_FIELD = "{prompt}"  # an argument holding it gets the prompt in its place
MAX_OUTPUT_BYTES = 1 << 16  # stdout and stderr each: an agent's answer, not its logs
# processes and threads at once (RLIMIT_NPROC counts both): an SDK's thread pools fit well below it
MAX_PROCESSES = 64
STDERR_TAIL = 2000  # characters of stderr a failed sample's error keeps


def parse_command(command: str) -> list[str]:
    """`agent.command` split into arguments as a POSIX shell would split it (no shell runs it);
    ValueError naming the option when it cannot be split or is empty."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise ValueError(f"agent.command: {command!r} cannot be split into arguments: {e}") from None
    if not argv:
        raise ValueError(f"agent.command: {command!r} names no program")
    return argv


def program_path() -> str:
    """The PATH a program is found on and runs with: the folder of the Python tidal runs on first
    (so `python` is tidal's own interpreter, with its packages, whether or not its environment
    was activated), then tidal's PATH."""
    here = os.path.dirname(sys.executable)
    rest = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return os.pathsep.join([here, *(p for p in rest if p and p != here)])


def resolve_program(program: str) -> str:
    """The absolute path of the command's program: a path (with a `/`) taken from tidal's working
    directory, a name looked up on `program_path()`; ValueError naming `agent.command` if it is
    not an executable file."""
    if "/" in program:
        full = os.path.abspath(program)
        if not (os.path.isfile(full) and os.access(full, os.X_OK)):
            raise ValueError(f"agent.command: {program!r} is not an executable file")
        return full
    found = shutil.which(program, path=program_path())
    if found is None:
        raise ValueError(f"agent.command: no program {program!r} beside tidal's Python or on PATH")
    return os.path.abspath(found)


def check_command(command: str) -> None:
    """Whether the command splits and its program exists (before the model loads); ValueError
    with the message otherwise."""
    resolve_program(parse_command(command)[0])


def program_argv(command: str, prompt: str) -> list[str]:
    """The argv run for one sample. The program runs in a directory of its own, so the program and
    every argument naming an existing file or folder relative to tidal's working directory are
    made absolute (`python agent.py` runs tidal's `agent.py`); `{prompt}` in an argument is
    replaced by the prompt, which is then taken as it is."""
    first, *rest = parse_command(command)
    argv = [resolve_program(first)]
    for arg in rest:
        if PROMPT_FIELD in arg:
            argv.append(arg.replace(PROMPT_FIELD, prompt))
        elif not arg.startswith("-") and os.path.exists(arg):
            argv.append(os.path.abspath(arg))
        else:
            argv.append(arg)
    return argv


def prompt_text(prompt: str | list[dict]) -> str:
    """The prompt as the program reads it: a string as it is, chat messages as their JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


def program_env(base_url: str, token: str, prompt: str, extra: dict[str, str]) -> dict[str, str]:
    """The program's environment over the sandbox's minimal one: `program_path()`, `agent.env`,
    then the door's endpoints and the prompt (which `agent.env` cannot override)."""
    return {
        "PATH": program_path(),
        **extra,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": token,
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": token,
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        PROMPT_ENV: prompt,
    }


async def run_program(cfg: AgentConfig, session: Session, base_url: str, prompt: str | list[dict]) -> None:
    """Run `agent.command` for one sample against its `session` (at `base_url`, whose API key is
    the session's token) and put what it printed and its exit status on the session's samples;
    RuntimeError, after that, if it did not exit 0 (see the module docstring)."""
    text = prompt_text(prompt)
    argv = program_argv(cfg.command, text)
    limits = SandboxConfig(
        backend="rlimits",
        timeout=cfg.timeout,
        memory_mb=cfg.memory_mb,
        max_processes=MAX_PROCESSES,
        max_output_bytes=MAX_OUTPUT_BYTES,
    )
    env = program_env(base_url, session.token, text, cfg.env)
    result = await arun_code(None, argv=argv, stdin=text, env=env, config=limits)
    async with session.lock:  # a call the program left behind is recorded (or dropped) before the samples are read
        pass
    for s in session.samples:
        s.metadata["agent_output"] = result.stdout
        s.metadata["agent_exit_code"] = result.exit_code
    if not result.ok:
        tail = result.stderr[-STDERR_TAIL:].strip()
        calls = f"{session.calls} call{'s' if session.calls != 1 else ''}"
        said = f"; stderr: {tail}" if tail else "; nothing on stderr"
        raise RuntimeError(f"agent.command: {argv[0]} {result.reason}, having made {calls} to the model{said}")
