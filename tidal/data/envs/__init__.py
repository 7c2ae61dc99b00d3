"""Built-in procedural environments: generated prompt rows that need no data file.

Each entry in `ENVS` returns a list of row dicts in the same shape a data file holds
(`prompt`, `label`, `metadata`), so `build_prompts` handles them like any other source.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from tidal.data.dataset import DataError
from tidal.data.envs import arithmetic

ENVS: dict[str, Callable[..., list[dict]]] = {
    "arithmetic": arithmetic.make_problems,
}


def make_env_rows(name: str, **kwargs) -> list[tuple[int, dict]]:
    """Generate an environment's rows as `(1-based row number, row)` pairs, like `read_rows`."""
    if name not in ENVS:
        raise DataError(f"unknown env {name!r}; known envs: {', '.join(sorted(ENVS))}")
    fn = ENVS[name]
    accepted = list(inspect.signature(fn).parameters)
    # Checked up front so a typo in a config names the bad key instead of a bare TypeError.
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise DataError(f"env {name!r} got unknown argument(s) {', '.join(unknown)}; accepted: {', '.join(accepted)}")
    return list(enumerate(fn(**kwargs), start=1))
