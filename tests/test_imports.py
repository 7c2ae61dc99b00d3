"""The package's layering, read from its source with `ast` (every import, function-level ones
included): rollout never imports the server, and the chat formats both share import neither."""

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


def imported(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module that module `name`'s `source` imports, absolute; `from a import b` counts as
    both `a` and `a.b` (b may be a submodule)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
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
