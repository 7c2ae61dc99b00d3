"""Print uv options, one per line, that make `uv pip install` look where pip looks here.

pip reads its config files and PIP_* variables (find-links, extra indexes, constraints, a CA
file); uv reads none of them. On a machine whose pip config points `find-links` at a folder with
the CPU build of torch, uv without the same option would take a CUDA torch from PyPI instead.
Run with the venv's Python: `python scripts/pip_to_uv.py`; prints nothing where pip has no config.
"""

import re
import subprocess
import sys

LIST_KEYS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
ONE_KEYS = {"index-url": "--index-url", "cert": "--cert"}


def pip_config() -> dict[str, list[str]]:
    """Key -> values from `pip config list`; a PIP_* variable (`:env:` keys) wins over the files."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    found: dict[str, list[str]] = {}
    from_env: set[str] = set()
    # lines look like  global.find-links='/opt/wheels'  or  :env:.find-links='...'; a value may span lines
    for m in re.finditer(r"^([^=\s]*)\.([a-z-]+)='(.*?)'$", out, re.M | re.S):
        variant, key, value = m.groups()
        if key not in LIST_KEYS and key not in ONE_KEYS:
            continue
        values = value.split()
        if variant == ":env:":
            found[key] = values
            from_env.add(key)
        elif key not in from_env:
            found.setdefault(key, [])
            found[key] += [v for v in values if v not in found[key]]
    return found


def main() -> None:
    config = pip_config()
    args: list[str] = []
    for key, flag in LIST_KEYS.items():
        for value in config.get(key, []):
            args += [flag, value]
    for key, flag in ONE_KEYS.items():
        if config.get(key):
            args += [flag, config[key][-1]]
    if "--extra-index-url" in args:
        # pip takes the best version across all its indexes; uv by default stops at the first index
        # that has the package
        args += ["--index-strategy", "unsafe-best-match"]
    print("\n".join(args))


if __name__ == "__main__":
    main()
