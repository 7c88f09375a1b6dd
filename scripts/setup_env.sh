#!/usr/bin/env bash
# Create or reuse .venv with a Python >= 3.12 found on this machine (PATH, then pyenv), install
# requirements.txt into it when it changed, and the project itself in editable mode (pyproject.toml)
# when the venv does not import it yet. Prints the venv's python path on stdout.
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
# The package in editable mode, so that tools/ and examples/ import it from any working directory:
# offline (no dependencies, the venv's own setuptools), when the venv imports no megatron_longstraw
# or imports this checkout's with another pyproject.toml. A venv that imports another checkout's
# (a clone sharing this venv) is left as it is: Python run in a checkout's root (python -m pytest,
# python train_grpo.py) imports that checkout's package first anyway.
probe='import importlib.util as u, os; s = u.find_spec("megatron_longstraw")
print(os.path.realpath(os.path.dirname(os.path.dirname(s.origin))) if s and s.origin else "")'
where=$(cd / && "$venv/bin/python" -E -c "$probe")
project_stamp="$venv/.project.sha256"
project_want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
if [ -z "$where" ] || { [ "$where" = "$(cd "$root" && pwd -P)" ] &&
                        [ "$(cat "$project_stamp" 2>/dev/null)" != "$project_want" ]; }; then
  if ! "$venv/bin/python" -c 'import sys, setuptools as s
sys.exit(tuple(int(x) for x in s.__version__.split(".")[:2]) < (70, 1))' 2>/dev/null; then
    echo "setup_env.sh: installing setuptools into $venv" >&2
    "$venv/bin/python" -m pip install -q "setuptools>=70.1" >&2
  fi
  echo "setup_env.sh: installing $root into $venv (editable)" >&2
  (cd / && PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation \
      -e "$root" >&2)  # quiet: setuptools warns about every editable install
  echo "$project_want" > "$project_stamp"
fi
echo "$venv/bin/python"
