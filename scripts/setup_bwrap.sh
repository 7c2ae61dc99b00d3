#!/usr/bin/env bash
# Install bubblewrap (the code sandbox's isolating backend) where it is missing and this user may:
# as root, or with sudo that needs no password, through apt-get. Says what it did or why not;
# exits 1 where bubblewrap is still not on PATH. TIDAL_INSTALL_BWRAP=0 leaves the system alone.
set -uo pipefail
if command -v bwrap >/dev/null; then exit 0; fi
why=""
if [ "${TIDAL_INSTALL_BWRAP:-1}" = 0 ]; then
  why="TIDAL_INSTALL_BWRAP=0"
elif ! command -v apt-get >/dev/null; then
  why="no apt-get here: install bubblewrap with this system's package manager"
else
  as=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      as=(sudo -n)
    else
      why="installing a system package needs root: sudo apt-get install bubblewrap"
    fi
  fi
  if [ -z "$why" ]; then
    echo "setup: installing bubblewrap (apt-get), the code sandbox's isolating backend"
    export DEBIAN_FRONTEND=noninteractive
    "${as[@]}" apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { "${as[@]}" apt-get update -qq >/dev/null 2>&1 && "${as[@]}" apt-get install -y -qq bubblewrap >/dev/null 2>&1; } \
      || why="apt-get install bubblewrap failed"
  fi
fi
if command -v bwrap >/dev/null; then exit 0; fi
echo "setup: bubblewrap is not installed (${why:-apt-get ran, but bwrap is not on PATH})" >&2
exit 1
