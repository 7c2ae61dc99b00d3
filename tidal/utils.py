"""Small helpers shared across tidal: loading user objects by dotted path and atomic file writes."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_tree",
    "import_path_env",
    "load_object",
    "put_cwd_on_path",
    "remove_stale_temps",
]


def _is_missing(err: ModuleNotFoundError, candidate: str) -> bool:
    """True when `err` says `candidate` itself (or one of its parent packages) does not exist.

    Any other ModuleNotFoundError comes from inside a module that does exist (a missing dependency)
    and must be reported as such rather than silently tried as an attribute path.
    """
    name = err.name or ""
    return bool(name) and (candidate == name or candidate.startswith(name + "."))


def _on_path(folder: str) -> bool:
    """Whether `folder` is an entry of the import path ('' stands for the working directory)."""
    return any(os.path.abspath(p or os.curdir) == folder for p in sys.path)


def _searched() -> str:
    """Where a module that is not found was looked for, for the error: the working directory (when
    it is on the import path), PYTHONPATH and the installed packages."""
    cwd = os.getcwd()
    pythonpath = os.environ.get("PYTHONPATH") or "unset"
    if _on_path(cwd):
        return f"looked in the working directory {cwd}, PYTHONPATH ({pythonpath}) and the installed packages"
    return (
        f"looked in PYTHONPATH ({pythonpath}) and the installed packages; the working directory {cwd} is not on "
        "the import path"
    )


def put_cwd_on_path() -> None:
    """Put the working directory first on the import path, as `python -m` does: `tidal train
    --reward.fn myrl.rewards:fn` finds `myrl/` where the command runs, though the `tidal` script's
    own folder is what Python put there."""
    cwd = os.getcwd()
    if not _on_path(cwd):
        sys.path.insert(0, cwd)


def import_path_env() -> str:
    """A PYTHONPATH for a process tidal starts apart from this one (a Ray actor), so that it finds
    the user code this process finds: each import-path entry that is not the interpreter's own (the
    working directory, PYTHONPATH, folders a script or test added), in order, then $PYTHONPATH."""
    own = [p for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix} if p]
    entries = []
    for p in sys.path:
        p = os.path.abspath(p or os.curdir)
        if any(p == o or p.startswith(o.rstrip(os.sep) + os.sep) for o in own) or not os.path.isdir(p):
            continue  # the standard library and site-packages: the other process has its own
        if p not in entries:
            entries.append(p)
    extra = [p for p in (os.environ.get("PYTHONPATH") or "").split(os.pathsep) if p and p not in entries]
    return os.pathsep.join(entries + extra)


def load_object(path: str, *, callable_required: bool = False) -> Any:
    """Import and return the object named by `path`.

    Two spellings are accepted:

    * ``pkg.mod:obj.attr`` -- everything before the colon is the module, the rest an attribute chain;
    * ``pkg.mod.obj`` -- the longest prefix that imports as a module is taken as the module and the
      remaining parts are looked up as attributes;
    * ``path/to/file.py:obj`` -- a Python file outside any installed package (a recipe's reward).

    Raises:
        ValueError: `path` is malformed (empty, no module/attribute separator, empty parts), or the
            object is not callable while `callable_required=True`.
        ImportError: the module cannot be found, importing it failed, or an attribute is missing.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"cannot load object from {path!r}: expected 'pkg.module:name' or 'pkg.module.name'")
    path = path.strip()

    shown = None  # how the module is named in errors, when not by its module name
    if ":" in path and path.partition(":")[0].endswith(".py"):
        module_name, attrs = _import_file(path)
        module = sys.modules[module_name]
        shown = module.__file__
    elif ":" in path:
        module_name, _, attr_chain = path.partition(":")
        attrs = attr_chain.split(".")
        if not module_name or any(not p for p in module_name.split(".")) or any(not a for a in attrs):
            raise ValueError(f"cannot load object from {path!r}: expected 'pkg.module:name' with non-empty parts")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if _is_missing(e, module_name):
                raise ImportError(f"cannot load {path!r}: module {module_name!r} not found ({e}); {_searched()}") from e
            raise ImportError(f"cannot load {path!r}: importing module {module_name!r} failed: {e}") from e
        except ImportError as e:
            raise ImportError(f"cannot load {path!r}: importing module {module_name!r} failed: {e}") from e
    else:
        parts = path.split(".")
        if len(parts) < 2 or any(not p for p in parts):
            raise ValueError(f"cannot load object from {path!r}: expected 'pkg.module:name' or 'pkg.module.name'")
        module = None
        # Longest module prefix first: `a.b.c` is more likely module `a.b` + attribute `c` than
        # module `a` + attributes `b.c`, and a real submodule must win over a same-named attribute.
        for split in range(len(parts) - 1, 0, -1):
            candidate = ".".join(parts[:split])
            try:
                module = importlib.import_module(candidate)
            except ModuleNotFoundError as e:
                if _is_missing(e, candidate):
                    continue
                raise ImportError(f"cannot load {path!r}: importing module {candidate!r} failed: {e}") from e
            except ImportError as e:
                raise ImportError(f"cannot load {path!r}: importing module {candidate!r} failed: {e}") from e
            module_name, attrs = candidate, parts[split:]
            break
        if module is None:
            raise ImportError(f"cannot load {path!r}: module {parts[0]!r} not found; {_searched()}")

    obj: Any = module
    owner = shown or module_name
    for attr in attrs:
        try:
            obj = getattr(obj, attr)
        except AttributeError as e:
            raise ImportError(f"cannot load {path!r}: {owner!r} has no attribute {attr!r}") from e
        owner = f"{owner}.{attr}"

    if callable_required and not callable(obj):
        raise ValueError(f"cannot load {path!r}: object of type {type(obj).__name__} is not callable")
    return obj


def _import_file(path: str) -> tuple[str, list[str]]:
    """Import `file.py` of `file.py:obj.attr` as a module named after its resolved path."""
    file_part, _, attr_chain = path.partition(":")
    file = Path(file_part).expanduser().resolve()
    attrs = attr_chain.split(".")
    if any(not a for a in attrs):
        raise ValueError(f"cannot load object from {path!r}: expected 'file.py:name' with a non-empty name")
    if not file.is_file():
        raise ImportError(f"cannot load {path!r}: file {str(file)!r} not found")
    name = "tidal_user_" + "_".join(file.with_suffix("").parts[1:]).replace("-", "_").replace(".", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ImportError(f"cannot load {path!r}: importing {str(file)!r} failed: {e}") from e
    return name, attrs


def _fsync_dir(directory: str) -> None:
    """Flush the directory entry so the rename itself survives a crash (POSIX only; best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows cannot open directories; the rename is still atomic there
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file under `root`, then every folder (deepest first), so the data a rename is
    about to publish is on disk before the rename is: otherwise a power loss can leave a folder
    that looks complete but holds empty or torn files."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def remove_stale_temps(directory: str | os.PathLike[str], final_name: str) -> list[Path]:
    """Remove what a killed `atomic_directory(directory / final_name)` or `atomic_write_bytes` left
    behind (hidden `.{final_name}.*` siblings; `final_name` may be a glob such as `step_*`).

    Only call it when no writer is running in `directory`: a live writer's temp file looks the same.
    Returns the removed paths."""
    removed = []
    for path in sorted(Path(directory).glob(f".{final_name}.*")):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace the file at `path` with `data` so readers see either the old or the new contents.

    The bytes go to a temporary file in the same directory (same filesystem, so the final
    `os.replace` is an atomic rename), are fsynced, then renamed over `path`. On any error the
    temporary file is removed and an existing file at `path` is left untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # A hidden, uniquely named sibling: concurrent writers never share a temp file, and os.open with
    # O_EXCL + mode 0o666 honours the umask (tempfile.mkstemp would force 0o600 on the result).
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # BaseException so a KeyboardInterrupt mid-write does not leave a stray temp file either.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Atomically replace `path` with `text` encoded as `encoding` (see `atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    """Atomically replace `path` with `obj` serialised as JSON plus a trailing newline.

    Serialisation happens before anything touches the disk, so an object that cannot be encoded
    raises without creating or damaging any file.
    """
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success its files are fsynced and it replaces
    `final` in one rename, on error it is removed and `final` (if any) is left as it was.
    A process killed inside leaves a hidden `.{final.name}.*` folder: see `remove_stale_temps`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(str(final.parent))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tidal_home() -> Path:
    """tidal's cache folder (converted models, built kernels): `$TIDAL_HOME`, else `~/.cache/tidal`."""
    return Path(os.environ.get("TIDAL_HOME") or os.path.join(Path.home(), ".cache", "tidal"))


def cache_argument(model: Any) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` in the releases
    that renamed it (where `past_key_values` warns on every call that it goes in 5.40),
    `past_key_values` in the earlier 5.x ones (e.g. 5.17, on the GPU machine)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
