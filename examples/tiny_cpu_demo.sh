#!/usr/bin/env bash
# GRPO on the tiny hybrid model and the synthetic retrieval task, on CPU (or one GPU), ~1 minute.
# Same as `python train_grpo.py` with its embedded defaults, spelled out; runs in the project's
# environment (PYTHON=... picks another interpreter: examples/args/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/args/env.sh
source examples/args/qwen3.5-debug.sh
"$PYTHON" train_grpo.py "${MODEL_ARGS[@]}" \
    --train-iters 4 --global-batch-size 2 --num-generations 4 \
    --lr 1e-3 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999 \
    --data-path synthetic --synthetic-prompt-length 256 --synthetic-num-records 4 \
    --reward-fn synthetic_retrieval --max-response-length 8 --temperature 1.0 \
    --prompt-chunk-size 64 --replay-micro-batch-size 2 \
    --save runs/grpo-demo/checkpoints --wandb-exp-name grpo-demo --wandb-save-dir runs/grpo-demo "$@"
