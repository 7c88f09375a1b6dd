#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite (CPU tier by default; GPU tests
# run where CUDA is available). Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
cd "$root"
# one intra-op thread per process: the tests' tiny models run faster without thread
# synchronization (the multi-process tests already use one per rank)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$py" -m pytest "$@"
