"""The package's layering, read from its source with `ast` (every import, function-level ones
included; those under `if TYPE_CHECKING:` are annotations, never run, and left out): no module
imports itself round a loop, neither does any room (a top-level module, or a package with
everything below it), rollout never imports the server, the chat formats both share import
neither, the backend table and the option machinery import nothing of tidal, and the config is
light (no torch, no web framework)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tidal

PACKAGE = Path(tidal.__file__).parent


def module_name(path: Path) -> str:
    """`tidal/rollout/agent.py` -> `tidal.rollout.agent`; a package's `__init__.py` -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (annotations: never imported at run time)."""
    return {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }


def imported(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module that module `name`'s `source` imports, absolute; `from a import b` counts as
    both `a` and `a.b` (b may be a submodule)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(source)
    annotations = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def imports_of(folder: str) -> dict[str, set[str]]:
    """{module: the modules it imports} for every module under `tidal/<folder>`."""
    files = sorted((PACKAGE / folder).rglob("*.py"))
    assert files, f"no modules under tidal/{folder}"
    return {
        module_name(f): imported(f.read_text(encoding="utf-8"), module_name(f), f.name == "__init__.py") for f in files
    }


def reaching(imports: dict[str, set[str]], forbidden: str) -> dict[str, list[str]]:
    """The modules that import `forbidden` or anything below it, with what they import of it."""
    hits = {
        m: sorted(i for i in names if i == forbidden or i.startswith(forbidden + ".")) for m, names in imports.items()
    }
    return {m: names for m, names in hits.items() if names}


def test_imported_reads_absolute_relative_and_function_level_imports():
    source = """
import tidal.server.app
from tidal import server
from ..chat import tools
from . import generate

def later():
    from tidal.server.common import Texts
"""
    found = imported(source, "tidal.rollout.agent")
    assert {"tidal.server.app", "tidal.server", "tidal.chat.tools", "tidal.rollout.generate"} <= found
    assert "tidal.server.common" in found
    assert reaching({"m": found}, "tidal.server") == {
        "m": ["tidal.server", "tidal.server.app", "tidal.server.common", "tidal.server.common.Texts"]
    }


def test_rollout_does_not_import_the_server():
    assert reaching(imports_of("rollout"), "tidal.server") == {}


@pytest.mark.parametrize("forbidden", ["tidal.server", "tidal.rollout"])
def test_the_chat_formats_import_neither_the_server_nor_rollout(forbidden):
    assert reaching(imports_of("chat"), forbidden) == {}


def test_config_imports_the_server_options_without_fastapi_or_torch():
    code = "import sys, tidal.config; print(sorted({'fastapi', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def module_graph() -> dict[str, set[str]]:
    """{module: the tidal modules it imports} over the whole package (names that are not modules,
    `from a import b` with b a function, count as `a`)."""
    raw = imports_of(".")
    modules = set(raw)
    return {m: {i if i in modules else i.rpartition(".")[0] for i in names} & modules - {m} for m, names in raw.items()}


def room(module: str) -> str:
    """`tidal.rollout.agent` -> `tidal.rollout` (a package is one room), `tidal.loop` -> itself."""
    return ".".join(module.split(".")[:2])


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_loops_finds_a_cycle_and_only_that():
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_round_a_loop():
    assert loops(module_graph()) == []


def test_no_room_imports_itself_round_a_loop():
    """A package as a whole never imports a room that imports it back: every arrow runs down
    (the config groups live in each package's light `options` module, and the modules that read
    the whole config, `tidal.roles`, `tidal.eval`, `tidal.loop`, stand above `tidal.config`)."""
    rooms: dict[str, set[str]] = {}
    for m, names in module_graph().items():
        rooms.setdefault(room(m), set()).update(room(n) for n in names if room(n) != room(m))
    assert loops(rooms) == []


@pytest.mark.parametrize("module", ["tidal.backends", "tidal.options"])
def test_the_table_and_the_option_machinery_import_nothing_of_tidal(module):
    assert module_graph()[module] == set()


def test_only_the_drivers_read_the_whole_config():
    """Each part gets the groups it needs: below the drivers nothing imports `tidal.config`."""
    drivers = {"tidal.cli", "tidal.loop", "tidal.roles", "tidal.eval", "tidal.run_dir", "tidal.report", "tidal.api"}
    readers = {m for m, names in module_graph().items() if "tidal.config" in names}
    assert readers <= drivers, sorted(readers - drivers)
