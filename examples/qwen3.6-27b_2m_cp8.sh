#!/usr/bin/env bash
# The paper's headline: Qwen3.6-27B, a 2,088,960-token prompt + 8,192-token responses, G=8, on
# 8 GPUs with context parallelism 8 (prompt pages sharded over the CP ranks; rollouts decode from
# the sharded state). Verified so far on CPU (CP=2 = CP=1); the 8-GPU run is the headline issue.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/args/qwen3.6-27b.sh
torchrun --nproc-per-node 8 train_grpo.py "${MODEL_ARGS[@]}" \
    --tensor-model-parallel-size 1 --context-parallel-size 8 --pipeline-model-parallel-size 1 \
    --use-distributed-optimizer --recompute-granularity full \
    --train-iters 1 --global-batch-size 1 --num-generations 8 \
    --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 0 --weight-decay 0.01 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 \
    --data-path synthetic --synthetic-prompt-length 2088960 --synthetic-num-records 64 \
    --reward-fn synthetic_retrieval --max-response-length 8192 \
    --prompt-chunk-size 32768 --replay-micro-batch-size 1 --replay-mode longstraw \
    --save runs/qwen3.6-27b-2m/checkpoints --wandb-project megatron-longstraw \
    --wandb-exp-name qwen3.6-27b-2m-g8 --wandb-save-dir runs/qwen3.6-27b-2m "$@"
