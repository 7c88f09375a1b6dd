#!/usr/bin/env bash
# GLM-5 at a 2,088,960-token prompt on 32 GPUs (4 nodes x 8): TP 1, CP 32, EP 32, G=8. Launch on
# every node with its NODE_RANK and the first node's MASTER_ADDR. Needs GLM-5 (MLA/DSA) under
# LongStraw CP; until then the trainer refuses it clearly.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/args/glm-5.sh
torchrun --nnodes 4 --nproc-per-node 8 --node-rank "${NODE_RANK:?set NODE_RANK}" \
    --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}" \
    train_grpo.py "${MODEL_ARGS[@]}" \
    --tensor-model-parallel-size 1 --context-parallel-size 32 --expert-model-parallel-size 32 \
    --use-distributed-optimizer --recompute-granularity full \
    --train-iters 1 --global-batch-size 1 --num-generations 8 \
    --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 \
    --data-path synthetic --synthetic-prompt-length 2088960 --synthetic-num-records 64 \
    --reward-fn synthetic_retrieval --max-response-length 8192 \
    --prompt-chunk-size 32768 --replay-micro-batch-size 1 \
    --save runs/glm-5-2m/checkpoints --wandb-project megatron-longstraw \
    --wandb-exp-name glm-5-2m-g8 --wandb-save-dir runs/glm-5-2m "$@"
