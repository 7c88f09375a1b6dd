#!/usr/bin/env bash
# The retrieval learning study on one GPU: GRPO from random weights on the synthetic task (one
# record, one-token values over three content ids: a formatted guess earns 1/3, reading the
# prompt 1.0), the same model, data, seeds and steps in each --prompt-gradient mode, with a
# prompt-length curriculum to 32K and held-out evaluation every 25 steps.
#
#   bash examples/retrieval_study.sh exact          # then: detached
#   bash examples/retrieval_study.sh exact --skip-train --eval-prompt-lengths 131072,524288
#
# Each launch stops after about 7 minutes of training with a checkpoint (--exit-duration-in-mins)
# and the same command continues the run, so it fits a job time limit; the metrics continue in
# runs/retrieval-<mode>/metrics.jsonl. The curves side by side:
#   python tools/plot_metrics.py exact=runs/retrieval-exact/metrics.jsonl \
#       detached=runs/retrieval-detached/metrics.jsonl --keys reward/mean,eval/greedy_reward \
#       --hline "0.333:format ceiling" --output docs/learning.png
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/args/env.sh
mode=${1:?usage: retrieval_study.sh exact|detached [train_grpo.py args ...]}
shift
case "$mode" in exact|detached) ;; *) echo "error: the mode must be exact or detached, got '$mode'" >&2; exit 2 ;; esac
"$PYTHON" train_grpo.py --hf-config examples/configs/qwen3.5-retrieval-small.json --bf16 \
    --max-position-embeddings 1048576 --prompt-gradient "$mode" \
    --data-path synthetic --synthetic-num-records 1 --synthetic-value-length 1 \
    --reward-fn synthetic_retrieval --max-response-length 2 \
    --prompt-length-schedule 512:150,4096:100,32768 --prompt-chunk-size 32768 \
    --train-iters 400 --global-batch-size 8 --num-generations 8 --replay-micro-batch-size 8 \
    --lr 1e-3 --clip-grad 1.0 --seed 1 \
    --eval-interval 25 --eval-prompts 32 --eval-prompt-lengths 512,32768 \
    --exit-duration-in-mins 7 --save-interval 50 \
    --save "runs/retrieval-$mode/checkpoints" --wandb-exp-name "retrieval-$mode" \
    --wandb-save-dir "runs/retrieval-$mode" "$@"
