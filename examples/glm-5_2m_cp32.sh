#!/usr/bin/env bash
# GRPO on GLM-5 with 2,088,960-token prompts and G=8 on 32 GPUs (4 nodes of 8 H200): TP 1,
# CP 32, EP 32. The prompt's MLA latents and DSA indexer keys are sharded over the CP ranks and
# rollouts decode from the sharded state; with ROLLOUT_PATH the prompt groups come from a rollout
# JSONL instead (README: data formats): prompts with G responses each, sampled by an inference
# engine (vLLM, SGLang).
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=node0 DATA_PATH=prompts.jsonl \
#       TOKENIZER_MODEL=/path/to/GLM-5 PRETRAINED_CHECKPOINT=/path/to/mcore \
#       bash examples/glm-5_2m_cp32.sh                               # on each node
#   sbatch examples/slurm/glm-5_2m.sbatch                            # SLURM
#
# Memory: full-parameter training of GLM-5's 744B parameters (bf16 weights, fp32 gradients and
# Adam states) is predicted to need about 548 GiB per GPU on this layout, so the trainer refuses
# it at start-up on 32 H200s; at this prompt the planner fits it on 256 H200s (128 do not)
# (CP 128, PP 2, EP 128): python tools/plan_budget.py --model glm-5 --num-gpus 256 \
#     --prompt-length 2088960 --num-generations 8 --global-batch-size 1 --use-distributed-optimizer
#     (docs/planning.md).
# What it reads and writes: examples/args/recipe.sh. Extra arguments go to train_grpo.py. A
# relaunch resumes from CHECKPOINT_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/glm-5-2m}
NNODES=${NNODES:-${SLURM_NNODES:-4}}
source examples/args/env.sh
source examples/args/distributed.sh
source examples/args/glm-5.sh
source examples/args/recipe.sh
"${TORCHRUN[@]}" "${DISTRIBUTED_ARGS[@]}" train_grpo.py "${MODEL_ARGS[@]}" \
    --tensor-model-parallel-size 1 --context-parallel-size 32 --expert-model-parallel-size 32 \
    --use-distributed-optimizer --recompute-granularity full \
    --train-iters "${TRAIN_ITERS:-200}" --save-interval "${SAVE_INTERVAL:-10}" \
    --global-batch-size "${GLOBAL_BATCH_SIZE:-$((WORLD_SIZE / 32))}" --num-generations 8 \
    --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.01 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 \
    --max-prompt-length 2088960 --max-response-length 8192 \
    --prompt-chunk-size 32768 --replay-micro-batch-size 1 \
    --wandb-project megatron-longstraw --wandb-exp-name glm-5-2m-g8 \
    "${RECIPE_ARGS[@]}" "$@"
