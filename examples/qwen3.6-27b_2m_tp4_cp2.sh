#!/usr/bin/env bash
# GRPO on Qwen3.6-27B with 2,088,960-token prompts, 8,192-token responses and G=8, on nodes of
# 8 H200 (141 GB): TP 4 x CP 2 per model replica (prompt pages sharded over the CP ranks, heads
# over TP; rollouts decode from the sharded state), data parallel over the replicas.
#
#   bash examples/qwen3.6-27b_2m_tp4_cp2.sh                          # one node
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/qwen3.6-27b_2m_tp4_cp2.sh   # on each node
#   sbatch examples/slurm/qwen3.6-27b_2m.sbatch                      # SLURM
#
# What it reads and writes: examples/args/recipe.sh (CHECKPOINT_PATH, PRETRAINED_CHECKPOINT,
# DATA_PATH + TOKENIZER_MODEL, REWARD_FN, ...); unset, it trains random weights on the synthetic
# retrieval task. Extra arguments go to train_grpo.py. A relaunch resumes from CHECKPOINT_PATH.
#
# Memory per GPU: CP replicates the weights. Per parameter a rank holds bf16 weights (2 B) + fp32
# gradient buffers (4 B) + its 1/(DP x CP) share of the distributed optimizer's fp32 main weights
# and Adam moments (12 B): 27e9 / TP 4 x (6 + 12/2) = 81 GB at one node, plus the prompt state
# (16 attention layers x 4 KV heads x 256 x (K, V) x 2 B = 64 KiB per token, 137 GB for the
# prompt, / CP 2 / TP 4 = 17 GB), plus one recomputed 8K response's activations: about 100 GB.
# (The paper's CP 8 would hold 27e9 x (6 + 12/8) = 202 GB of weights and optimizer per GPU.)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/qwen3.6-27b-2m}
source examples/args/env.sh
source examples/args/distributed.sh
source examples/args/qwen3.6-27b.sh
source examples/args/recipe.sh
REPLICAS=$((WORLD_SIZE / 8))  # data-parallel replicas of TP 4 x CP 2
"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" train_grpo.py "${MODEL_ARGS[@]}" \
    --tensor-model-parallel-size 4 --context-parallel-size 2 --pipeline-model-parallel-size 1 \
    --use-distributed-optimizer --recompute-granularity full \
    --train-iters "${TRAIN_ITERS:-200}" --save-interval "${SAVE_INTERVAL:-10}" \
    --global-batch-size "${GLOBAL_BATCH_SIZE:-$REPLICAS}" --num-generations 8 \
    --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.01 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 \
    --data-path synthetic --synthetic-prompt-length 2088960 --synthetic-num-records 64 \
    --max-response-length 8192 --prompt-chunk-size 32768 --replay-micro-batch-size 1 \
    --wandb-project megatron-longstraw --wandb-exp-name qwen3.6-27b-2m-g8 \
    "${RECIPE_ARGS[@]}" "$@"
