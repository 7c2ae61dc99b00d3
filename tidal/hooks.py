"""User code a config names (rewards, generate functions, the agent, tools, estimators, losses,
filters, buffers), imported and checked before anything else loads: a typo in `reward.fn` is an
error naming `reward.fn` in a second, not a traceback after the model and the engine have loaded.

The program of `agent.command` is not Python: what is checked of it is that its program is found.

The run imports each again where it uses it; what is checked here is that it imports, is callable,
and takes the arguments tidal will call it with. User modules are found as `python -m` finds them:
the working directory first, then PYTHONPATH and the installed packages (`put_cwd_on_path`); a file
anywhere is named by its path (`path/to/file.py:fn`).

A prompt row may name its own generate function in its metadata (`rollout.generate`'s help): that
one is loaded when the row is first rolled out, as the data is read after the model's tokenizer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.options import USER_CODE, ConfigError, is_dotted
from tidal.utils import load_object, put_cwd_on_path

if TYPE_CHECKING:
    from tidal.config import Config

FORMS = f"a user function is given as {USER_CODE}"


@dataclass(frozen=True)
class Hook:
    """What tidal calls a user object of an option with: `args` positional arguments (None: tidal
    checks it in its own loader), described to the user as `call`."""

    args: int | None
    call: str


# every option that takes user code, and how it is called; an option added here is checked
HOOKS: dict[str, Hook] = {
    "reward.fn": Hook(1, "reward(sample) -> float | dict, sync or async"),
    "reward.group_fn": Hook(1, "group_reward(samples) -> list[float | dict], sync or async"),
    "rollout.generate": Hook(None, "async def generate(ctx, sample, sampling)"),
    "agent.fn": Hook(None, "async def agent(client, prompt, label)"),
    "tools.names": Hook(None, "a function with type-hinted parameters, called with keyword arguments"),
    "algo.advantage": Hook(4, "advantage(rewards, mask, group_size, samples) -> [N] or [N, R] advantages"),
    "algo.policy_loss": Hook(5, "policy_loss(logp, old_logp, advantages, mask, algo) -> (per_token_loss, metrics)"),
    "algo.dynamic_sampling_filter": Hook(1, "keep(group: list[Sample]) -> bool"),
    "overlap.buffer": Hook(0, "a class whose instances have add, get, state_dict and load_state_dict"),
    "overlap.buffer_filter": Hook(3, "buffer_filter(groups, n, step) -> list[int]"),
}
BUFFER_METHODS = ("add", "get", "state_dict", "load_state_dict")


def _hooks(cfg: Config) -> list[tuple[str, str]]:
    """(option, value) of every user function or class the config names, and of every value of
    those options that is neither built in nor a path (a misspelt built-in name)."""
    found = [
        ("reward.fn", "" if cfg.reward.group_fn else cfg.reward.fn),
        ("reward.group_fn", cfg.reward.group_fn),
        ("rollout.generate", cfg.rollout.generate),
        ("algo.advantage", cfg.algo.advantage),
        ("algo.policy_loss", cfg.algo.policy_loss),
        ("algo.dynamic_sampling_filter", cfg.algo.dynamic_sampling_filter),
    ]
    if cfg.overlap.mode != "off":  # the buffer exists only then
        found += [("overlap.buffer", cfg.overlap.buffer), ("overlap.buffer_filter", cfg.overlap.buffer_filter)]
    if cfg.rollout.generate == "agent":
        found.append(("agent.fn", cfg.agent.fn))
    if cfg.rollout.generate == "tools":
        found += [("tools.names", name) for name in cfg.tools.names]
    return [(option, value) for option, value in found if value]


def _builtins(option: str) -> tuple[str, ...] | None:
    """The built-in names of an option whose group check does not already refuse an unknown name;
    None for the others."""
    if option == "reward.fn":
        from tidal.reward.score import BUILTIN_SAMPLE_REWARDS
        from tidal.reward.verifiers import BUILTIN_REWARDS

        return (*BUILTIN_REWARDS, *BUILTIN_SAMPLE_REWARDS, "judge", "rm")
    if option == "tools.names":
        from tidal.rollout.multi_turn import BUILTIN_TOOLS

        return tuple(BUILTIN_TOOLS)
    if option == "overlap.buffer_filter":
        from tidal.rollout.buffer import BUFFER_FILTERS

        return tuple(BUFFER_FILTERS)
    return None


def check_user_code(cfg: Config) -> None:
    """Import every user function the config names; ConfigError lists each that cannot be loaded
    (naming its option, the path, why, and the forms that work), that does not take what tidal
    gives it, or a name that is neither built in nor a path.

    Puts the working directory first on the import path (`put_cwd_on_path`), as the `tidal`
    command does, so the Python API finds user modules where the command would."""
    put_cwd_on_path()
    errors = []
    for option, value in _hooks(cfg):
        if not is_dotted(value):
            builtins = _builtins(option)
            if builtins is not None and value not in builtins:
                errors.append(
                    f"{option}: {value!r} is neither built in ({', '.join(builtins)}) nor a path to a function; {FORMS}"
                )
            continue
        try:
            obj = load_object(value, callable_required=True)
        except (ImportError, ValueError, SyntaxError) as e:
            errors.append(f"{option}: {e}; {FORMS}")  # the loader says which path and why
            continue
        try:
            _check(option, value, obj)
        except ValueError as e:  # the message names the option and the signature
            errors.append(str(e))
    if cfg.rollout.generate == "agent" and cfg.agent.command:  # a program, not Python: it must exist
        from tidal.rollout.program import check_command

        try:
            check_command(cfg.agent.command)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _check(option: str, value: str, obj: Any) -> None:
    """What tidal knows of the signature each option's function must have; ValueError naming the
    option, the path and the call expected."""
    hook = HOOKS[option]
    if option == "rollout.generate":
        from tidal.rollout.manager import load_generate_fn

        load_generate_fn(value, option)
    elif option == "agent.fn":
        from tidal.rollout.agent import load_agent

        load_agent(value)
        _takes(option, value, obj, 3, hook.call)
    elif option == "tools.names":
        from tidal.rollout.multi_turn import tool_spec

        try:
            tool_spec(obj)
        except Exception as e:  # an annotation that does not resolve, a builtin without a signature
            raise ValueError(f"{option}: {value!r} cannot be described to the model as a tool: {e}") from None
    elif option == "overlap.buffer":
        _takes(option, value, obj, 0, hook.call)
        missing = [m for m in BUFFER_METHODS if not callable(getattr(obj, m, None))]
        if missing:
            raise ValueError(f"{option}: {value!r} has no {', '.join(missing)}; expected {hook.call}")
    elif hook.args is not None:
        _takes(option, value, obj, hook.args, hook.call)


def _takes(option: str, value: str, fn: Any, n: int, call: str) -> None:
    """ValueError unless `fn` can be called with `n` positional arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension callable: nothing to read
        return
    try:
        signature.bind(*range(n))
    except TypeError:
        raise ValueError(
            f"{option}: {value!r} takes ({', '.join(signature.parameters)}); tidal calls it with {n} "
            f"argument{'s' if n != 1 else ''}: {call}"
        ) from None
