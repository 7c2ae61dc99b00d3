"""The suite's pytest-xdist groups (scripts/test.sh runs `--dist loadgroup`), as a hook that
tests/conftest.py takes in: every test on the `ray_session` fixture runs in one worker, one after
another. Each worker that ran one would start a Ray of its own (its processes, idle workers and
actors): on 2 cores, three at once made each Ray test about ten times slower than alone (CI's
durations: 145-210 s against 15-18 s). Tests marked `xdist_group` by hand keep their group."""

from __future__ import annotations

import pytest

RAY_GROUP = "ray"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
