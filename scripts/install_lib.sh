# Sourced by setup.sh and setup_vllm.sh once their venv is active: `pkg_install ARGS...` runs
# `uv pip install ARGS` (uv put into the venv by pip, told where pip looks for packages here), or
# `pip install ARGS` where uv cannot be had, where it fails, or with TIDAL_INSTALLER=pip.
# Both skip what is already installed: a second set-up only rebuilds tidal's editable install.
export PIP_DISABLE_PIP_VERSION_CHECK=1
_uv=""
if [ "${TIDAL_INSTALLER:-uv}" != pip ]; then
  _uv="$VIRTUAL_ENV/bin/uv"
  if [ ! -x "$_uv" ] && ! python -m pip install -q "uv>=0.9,<1"; then
    echo "setup: could not install uv; installing with pip (slower)" >&2
    _uv=""
  fi
fi
_uv_args=()
if [ -n "$_uv" ]; then
  # pip's find-links, indexes, constraints and CA file (uv reads no pip config); here find-links is
  # where the CPU build of torch lies, without which uv would take a multi-GB CUDA build from PyPI
  mapfile -t _uv_args < <(python "$(dirname "${BASH_SOURCE[0]}")/pip_to_uv.py")
fi

pkg_install() {
  if [ -n "$_uv" ]; then
    if "$_uv" pip install -q --python "$VIRTUAL_ENV/bin/python" "${_uv_args[@]}" "$@"; then
      return 0
    fi
    echo "setup: uv failed to install '$*'; using pip from here on" >&2
    _uv=""
  fi
  python -m pip install -q "$@"
}

pkg_uninstall() {
  if [ -n "$_uv" ]; then
    "$_uv" pip uninstall -q --python "$VIRTUAL_ENV/bin/python" "$@" 2>/dev/null || true
  else
    python -m pip uninstall -q -y "$@" 2>/dev/null || true
  fi
}

# Where PYTHONDONTWRITEBYTECODE is set, write the venv's bytecode (.pyc) now, once, and that of
# the folders given (tidal's own code, installed editable). uv installs none (pip does), and with
# that variable Python writes none at import either: every process then compiles what it imports
# from source (torch, transformers, Ray, vLLM: seconds of CPU each), and the tests start hundreds
# of processes (pytest-xdist workers, Ray workers, CLI runs, reward workers). Without it the first
# import of each module writes its bytecode, and nothing is done here. Files already compiled are
# skipped, so a second set-up spends a few seconds here.
compile_venv() {
  if [ -z "${PYTHONDONTWRITEBYTECODE:-}" ]; then return 0; fi
  python - "$@" <<'PY' || echo "setup: could not write the bytecode; Python compiles at import instead" >&2
import compileall, sys, sysconfig
# one compiling process per core; quiet=2: the few files of test data in some packages that are
# not valid Python 3 (never imported) are skipped without a message
for folder in [sysconfig.get_paths()["purelib"], *sys.argv[1:]]:
    compileall.compile_dir(folder, quiet=2, workers=0)
PY
}
