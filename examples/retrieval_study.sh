#!/usr/bin/env bash
# The retrieval learning study on one GPU: the synthetic task (one record, one-token values over
# three content ids: a formatted guess earns 1/3, reading the prompt 1.0) with the two-layer
# hybrid model from random weights, the same model, data, seeds and steps in each
# --prompt-gradient mode:
#   1. a warm start: 25 supervised steps (--loss-type sft) at 32-token prompts; it teaches the
#      answer's format (in the exact mode also the lookup at short prompts), while the held-out
#      greedy reward at 32K stays at the format ceiling;
#   2. GRPO from it, with a prompt-length curriculum from 32 tokens to 32K (50 steps at each of
#      32, 512 and 4096, then 32K) and held-out evaluation every 25 steps.
# Both phases capture a prompt of up to 32K tokens as one chunk (--prompt-chunk-size 32768), so
# the held-out evaluation at 32K runs one chunk per prompt (at the warm start's 32-token prompts a
# 32-token chunk would mean 1,024 chunks per evaluated prompt).
#
#   bash examples/retrieval_study.sh exact          # then: detached
#   bash examples/retrieval_study.sh exact --skip-train --eval-prompt-lengths 131072,524288
#
# The run's folder is runs/retrieval-<mode> (or $RUN_DIR). The warm start runs once (its
# checkpoint in <folder>/warm); each launch of the GRPO phase stops after about 7 minutes of
# training with a checkpoint (--exit-duration-in-mins) and the same command continues it, so it
# fits a job time limit; its metrics continue in <folder>/metrics.jsonl. The curves side by side:
#   python tools/plot_metrics.py exact=runs/retrieval-exact/metrics.jsonl \
#       detached=runs/retrieval-detached/metrics.jsonl --keys reward/mean,eval/greedy_reward \
#       --hline "0.333:format ceiling" --output docs/learning.png
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/args/env.sh
mode=${1:?usage: retrieval_study.sh exact|detached [train_grpo.py args ...]}
shift
case "$mode" in exact|detached) ;; *) echo "error: the mode must be exact or detached, got '$mode'" >&2; exit 2 ;; esac
run=${RUN_DIR:-runs/retrieval-$mode}
common=(--hf-config examples/configs/qwen3.5-retrieval-tiny.json --bf16 --max-position-embeddings 1048576
        --prompt-gradient "$mode" --data-path synthetic --synthetic-num-records 1 --synthetic-value-length 1
        --reward-fn synthetic_retrieval --max-response-length 2 --global-batch-size 8 --replay-micro-batch-size 16
        --clip-grad 1.0 --seed 1 --eval-interval 25 --eval-prompts 64 --eval-prompt-lengths 512,32768)
if [ ! -f "$run/warm/latest_checkpointed_iteration.txt" ]; then
  "$PYTHON" train_grpo.py "${common[@]}" --loss-type sft --num-generations 2 --lr 3e-3 --train-iters 25 \
      --synthetic-prompt-length 32 --prompt-chunk-size 32768 \
      --save "$run/warm" --wandb-exp-name "retrieval-$mode-warm" --wandb-save-dir "$run/warm-metrics"
fi
"$PYTHON" train_grpo.py "${common[@]}" --pretrained-checkpoint "$run/warm" \
    --num-generations 8 --lr 1e-3 --entropy-coef 0.05 \
    --prompt-length-schedule 32:50,512:50,4096:50,32768 --prompt-chunk-size 32768 --train-iters 250 \
    --exit-duration-in-mins 7 --save-interval 50 \
    --save "$run/checkpoints" --wandb-exp-name "retrieval-$mode" --wandb-save-dir "$run" "$@"
