#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite (CPU tier by default; GPU tests
# run where CUDA is available). Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
cd "$root"
exec "$py" -m pytest "$@"
