"""What every config group is made of: `opt` (a field with its `--help` text), `ConfigError`, and
`Need`, the collector a group's `check` reports its problems to.

A group is a dataclass beside the component it configures (`tidal.train.options.TrainConfig`,
`tidal.reward.options.JudgeConfig`, ...) with a `check(need)` method for what it can say alone;
`tidal.config` assembles the groups, reads YAML and the command line, and checks what spans
several groups. This module imports nothing from tidal, so every options module can import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "USER_CODE",
    "ConfigError",
    "Need",
    "coerce",
    "did_you_mean",
    "is_dotted",
    "nearest_names",
    "one_of",
    "opt",
    "type_name",
    "unknown_name",
]

# `need(ok, message)`: when `ok` is false, `message` (`group.key: what is wrong; what to do`) is
# one of the problems `tidal.config.validate` reports together
Need = Callable[[bool, str], None]


# how an option names user code, in every such option's help and in the errors of `tidal.hooks`
USER_CODE = "pkg.module:fn (a module importable from the working directory or PYTHONPATH) or path/to/file.py:fn"


class ConfigError(ValueError):
    """Raised with every problem found, one per line: `field: what is wrong; what to do`."""


def opt(default: Any, help: str, *, secret: bool = False, **kw: Any) -> Any:
    """A config field with its `--help` text. `secret=True` marks a value that must never reach a
    file, a page or a log: `tidal.config.redact` masks it in every config dict tidal writes or
    shows (config.json, the report, wandb), the dataclass repr leaves it out (logs, tracebacks),
    and the command line takes it verbatim (see `tidal.config.SECRET_FIELDS`)."""
    metadata = {"help": help, "secret": secret}
    if secret:
        kw.setdefault("repr", False)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return dataclasses.field(default=default, metadata=metadata, **kw)


def is_dotted(name: str) -> bool:
    """A user function given as `pkg.module:fn`, `pkg.module.fn` or `file.py:fn`."""
    return ":" in name or ("." in name and not name.startswith("."))


def one_of(need: Need, name: str, value: Any, choices: tuple | list | dict) -> None:
    """`need` that `value` of the option `name` is one of `choices`, naming them when it is not."""
    need(value in choices, f"{name}: one of {', '.join(choices)}, got {value!r}")


def unknown_name(kind: str, name: str, known: list[str]) -> str:
    """`unknown <kind> 'name'` with the closest known name, or all of them when none is close."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"
    return f"unknown {kind} {name!r}{hint}"


def nearest_names(name: str, known: Sequence[str], aliases: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """The `group.key` names of `known` that an unknown `name` most likely means, best first;
    empty when nothing is near. `name` may come with dashes (`--train-lr`), without its group
    (`lr`) or in another framework's words: `aliases` maps such a word (`learning_rate`) or dotted
    name (`data.train_batch_size`) to what it means here.

    Tried in order, the first that finds something wins: an alias of the whole name or of its last
    part; known names with the same last part (`--seed`: every group's seed); a misspelling of a
    known name (`train.lrr`); a misspelling of an alias or of a known last part."""
    aliases = aliases or {}
    norm = name.strip().lstrip("-").replace("-", "_").lower()
    leaf = norm.rpartition(".")[2]
    if norm in known:
        return [norm]
    for word in (norm, leaf):
        if word in aliases:
            return [k for k in aliases[word] if k in known]
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf
    close = difflib.get_close_matches(norm, known, n=1)
    if close:
        return close
    by_leaf: dict[str, list[str]] = {}
    for k in known:
        by_leaf.setdefault(k.rpartition(".")[2], []).append(k)
    for word in difflib.get_close_matches(leaf, [*aliases, *by_leaf], n=1, cutoff=0.8):
        return [k for k in aliases[word] if k in known] if word in aliases else by_leaf[word]
    return []


def did_you_mean(names: Sequence[str], prefix: str = "") -> str:
    """`did you mean 'a'?` or `did you mean one of 'a', 'b'?`, each name with `prefix` (`--`)."""
    quoted = ", ".join(repr(prefix + n) for n in names)
    return f"did you mean {'one of ' if len(names) > 1 else ''}{quoted}?"


def coerce(name: str, value: Any, tp: Any) -> Any:
    """Check `value` of the option `name` against the annotation `tp`, converting int to float
    where a float is wanted; ConfigError naming the option and the type expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(name, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{name}: expected {type_name(tp)}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{name}: expected int, got {value!r}")
    check = origin or tp
    if not isinstance(value, check):
        raise ConfigError(f"{name}: expected {type_name(tp)}, got {value!r}")
    return value


def type_name(tp: Any) -> str:
    """An annotation as `--help` and errors name it: `int`, `str or null`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))
