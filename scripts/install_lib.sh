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
