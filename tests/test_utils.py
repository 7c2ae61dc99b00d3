"""load_object path resolution and error messages; atomic writes."""

from __future__ import annotations

import collections
import json
import os
import os.path
import sys

import pytest

from tidal import utils
from tidal.utils import atomic_write_bytes, atomic_write_json, atomic_write_text, load_object


@pytest.mark.parametrize(
    "path,expected",
    [
        ("json:dumps", json.dumps),
        ("json.dumps", json.dumps),
        ("os.path:join", os.path.join),
        ("os.path.join", os.path.join),  # the submodule os.path wins over attribute lookup on os
        ("collections:OrderedDict.fromkeys", collections.OrderedDict.fromkeys),
        ("collections.OrderedDict.fromkeys", collections.OrderedDict.fromkeys),
        ("  json:loads ", json.loads),
    ],
)
def test_load_object_both_syntaxes(path, expected):
    assert load_object(path) == expected


def test_load_object_non_callable_allowed_by_default():
    assert load_object("json:__name__") == "json"


@pytest.mark.parametrize(
    "path,exc,pieces",
    [
        ("", ValueError, ["''", "pkg.module:name"]),
        ("json", ValueError, ["'json'", "pkg.module.name"]),
        ("json:", ValueError, ["'json:'", "non-empty"]),
        (":dumps", ValueError, ["':dumps'"]),
        ("json..dumps", ValueError, ["'json..dumps'"]),
        ("no_such_pkg_tidal_xyz.fn", ImportError, ["'no_such_pkg_tidal_xyz.fn'", "not found"]),
        ("no_such_pkg_tidal_xyz:fn", ImportError, ["'no_such_pkg_tidal_xyz'", "not found"]),
        ("json:nope", ImportError, ["'json:nope'", "'json' has no attribute 'nope'"]),
        ("json.nope", ImportError, ["'json.nope'", "'json' has no attribute 'nope'"]),
        ("json:decoder.nope", ImportError, ["'json.decoder' has no attribute 'nope'"]),
    ],
)
def test_load_object_errors(path, exc, pieces):
    with pytest.raises(exc) as err:
        load_object(path)
    for piece in pieces:
        assert piece in str(err.value)


def test_load_object_callable_required():
    assert load_object("json:dumps", callable_required=True) is json.dumps
    with pytest.raises(ValueError, match="'json:__name__'.*str is not callable"):
        load_object("json:__name__", callable_required=True)


def test_load_object_reports_broken_dependency(tmp_path, monkeypatch):
    """A module that exists but fails to import is reported as such, not as 'not found'."""
    (tmp_path / "tidal_test_broken_mod.py").write_text("import tidal_missing_dep_xyz\n\ndef fn():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tidal_test_broken_mod", raising=False)
    for path in ("tidal_test_broken_mod:fn", "tidal_test_broken_mod.fn"):
        with pytest.raises(ImportError) as err:
            load_object(path)
        msg = str(err.value)
        assert "importing module 'tidal_test_broken_mod' failed" in msg
        assert "tidal_missing_dep_xyz" in msg


def test_atomic_writes_roundtrip(tmp_path):
    p = tmp_path / "out.bin"
    atomic_write_bytes(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    atomic_write_text(str(p), "héllo\n")
    assert p.read_text(encoding="utf-8") == "héllo\n"
    atomic_write_json(p, {"a": [1, 2], "b": "ü"})
    assert json.loads(p.read_text(encoding="utf-8")) == {"a": [1, 2], "b": "ü"}
    assert p.read_text(encoding="utf-8").endswith("\n")
    assert os.listdir(tmp_path) == ["out.bin"]


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "state.json"
    atomic_write_json(p, {"step": 1})

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(utils.os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        atomic_write_json(p, {"step": 2})
    monkeypatch.undo()
    assert json.loads(p.read_text()) == {"step": 1}
    assert os.listdir(tmp_path) == ["state.json"]  # no temp file left behind


def test_atomic_write_failure_during_write(tmp_path, monkeypatch):
    p = tmp_path / "w.txt"
    atomic_write_text(p, "old")

    def boom(fd):
        raise OSError("fsync failed")

    monkeypatch.setattr(utils.os, "fsync", boom)
    with pytest.raises(OSError, match="fsync failed"):
        atomic_write_text(p, "new")
    monkeypatch.undo()
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["w.txt"]


def test_atomic_write_json_unserialisable_touches_nothing(tmp_path):
    p = tmp_path / "x.json"
    with pytest.raises(TypeError):
        atomic_write_json(p, {"a": object()})
    assert os.listdir(tmp_path) == []


def test_load_object_from_a_file_path(tmp_path):
    f = tmp_path / "my-reward.py"
    f.write_text("def score(sample):\n    return 0.5\n\nclass K:\n    x = 3\n")
    assert load_object(f"{f}:score")(None) == 0.5
    assert load_object(f"{f}:K.x") == 3
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        load_object(f"{f}:nope")
    with pytest.raises(ImportError, match="not found"):
        load_object(f"{tmp_path}/missing.py:score")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ImportError, match="importing .*bad.py' failed: boom"):
        load_object(f"{bad}:x")
