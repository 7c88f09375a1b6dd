#!/usr/bin/env bash
# Set up the environment if needed, then run the main job on its embedded default: GRPO with
# LongStraw on the tiny hybrid model and the synthetic retrieval task (train_grpo.py, no flags;
# wandb offline and a checkpoint under runs/grpo-demo/). Extra arguments go to train_grpo.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=$(bash "$root/scripts/setup_env.sh")
cd "$root"
exec "$py" train_grpo.py "$@"
