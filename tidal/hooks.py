"""User code a config names (rewards, generate functions, the agent, tools, estimators, losses,
filters, buffers), imported and checked before anything else loads: a typo in `reward.fn` is an
error naming `reward.fn` in a second, not a traceback after the model and the engine have loaded.

The run imports each again where it uses it; what is checked here is that it imports, is callable,
and (where tidal knows it) takes what it will be given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.options import ConfigError, is_dotted
from tidal.utils import load_object

if TYPE_CHECKING:
    from tidal.config import Config

FORMS = (
    "a user function is given as pkg.module:fn (a module importable from the working directory or PYTHONPATH) "
    "or path/to/file.py:fn"
)


def _hooks(cfg: Config) -> list[tuple[str, str]]:
    """(option, dotted path) of every user function or class the config names."""
    found = [
        ("reward.fn", cfg.reward.fn),
        ("reward.group_fn", cfg.reward.group_fn),
        ("rollout.generate", cfg.rollout.generate),
        ("algo.advantage", cfg.algo.advantage),
        ("algo.policy_loss", cfg.algo.policy_loss),
        ("algo.dynamic_sampling_filter", cfg.algo.dynamic_sampling_filter),
        ("overlap.buffer", cfg.overlap.buffer),
        ("overlap.buffer_filter", cfg.overlap.buffer_filter),
    ]
    if cfg.rollout.generate == "agent":
        found.append(("agent.fn", cfg.agent.fn))
    if cfg.rollout.generate == "tools":
        found += [("tools.names", name) for name in cfg.tools.names]
    return [(option, value) for option, value in found if value and is_dotted(value)]


def check_user_code(cfg: Config) -> None:
    """Import every user function the config names; ConfigError lists each that cannot be loaded
    (naming its option, the path, why, and the forms that work) or does not take what tidal
    gives it (a generate function's three arguments, the agent's coroutine)."""
    errors = []
    for option, value in _hooks(cfg):
        try:
            load_object(value, callable_required=True)
        except (ImportError, ValueError, SyntaxError) as e:
            errors.append(f"{option}: {e}; {FORMS}")  # the loader says which path and why
            continue
        try:
            _check(option, value)
        except ValueError as e:  # the loader's own message names the option and the signature
            errors.append(str(e))
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _check(option: str, value: str) -> None:
    """What tidal knows of the signature each option's function must have."""
    if option == "rollout.generate":
        from tidal.rollout.manager import load_generate_fn

        load_generate_fn(value, option)
    elif option == "agent.fn":
        from tidal.rollout.agent import load_agent

        load_agent(value)
