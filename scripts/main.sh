#!/usr/bin/env bash
# Set up the environment if needed, then run the main job on its embedded default.
# Until the GRPO trainer lands this is a forward/backward smoke run of both model families.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
cd "$root"
exec "$py" examples/smoke_forward_backward.py "$@"
