#!/usr/bin/env bash
# Create or reuse .venv with a Python >= 3.12 found on this machine (PATH, then pyenv), and
# install requirements.txt into it when it changed. Prints the venv's python path on stdout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${LONGSTRAW_VENV:-$root/.venv}

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
find_python() {
  local c
  for c in python3.12 python3.13 python3.14 python3; do
    if command -v "$c" >/dev/null && ok "$(command -v "$c")"; then command -v "$c"; return; fi
  done
  if command -v pyenv >/dev/null; then
    for c in "$(pyenv root)"/versions/3.1[2-9]*/bin/python3; do
      if [ -x "$c" ] && ok "$c"; then echo "$c"; return; fi
    done
  fi
  echo "setup_env.sh: no Python >= 3.12 found (PATH or pyenv); install one, e.g. 'pyenv install 3.12'" >&2
  exit 1
}

if [ ! -x "$venv/bin/python" ] || ! ok "$venv/bin/python"; then
  py=$(find_python)
  echo "setup_env.sh: creating $venv with $py" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$root/requirements.txt" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup_env.sh: installing requirements.txt into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$root/requirements.txt" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
