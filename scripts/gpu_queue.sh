#!/usr/bin/env bash
# Pending GPU runs, as one queue on a two-GPU host (nvidia-h200-x2), in priority order (what
# runs out of GPU time is at the end). After install-a and install-b:
#   bash scripts/gpu_queue.sh            (starts the queue and returns; see gpu_host.sh queue-*)
# then the Transformer Engine calls (te-piece x5, te-build) while it runs, then
#   bash scripts/gpu_host.sh queue-wait 560   (until it ends; each call returns what it has)
# Each item's output lands in NAME/ and NAME.log of the returned archive. The last item is #10's
# run scaled to two GPUs: qwen3.6-27b's widths at 8 of its 64 layers, the full 2.1M-token prompt
# over CP=2, G=2 and G=8 (the peak difference, and per-layer times to extrapolate to 8 GPUs).
# (The DSA tests, the FP8 rows at 512K and the linear FP8 bench run on one GPU: see below.)
# Keep a queue-wait call running: an idle machine is released after 30 s, and the queue with it.
set -euo pipefail
cd "$(dirname "$0")/.."
g="bash scripts/gpu_host.sh"
q08="--model qwen3.5-0.8b --max-position-embeddings 2200000 --modes longstraw --group-sizes 8"
# (with a 200 s limit the TP=2 phase gave no step and printed no error: likely the limit, while a
# fresh host compiles kernels for new shapes; hence eager helpers, an 8K prompt and 360 s, and
# each phase's exit status printed)
train="--hf-config examples/configs/qwen3.5-retrieval-small.json --bf16 --synthetic-prompt-length 8192 \
--synthetic-num-records 1 --max-response-length 4 --num-generations 8 --global-batch-size 8 \
--replay-micro-batch-size 8 --lr 1e-3 --train-iters 3"
if [ "$(nvidia-smi -L | wc -l)" -eq 1 ]; then
  # one GPU (nvidia-h200): what needs no second GPU. The TE/FP8 tests once TE is built (the FP8
  # gradient gap of #8: TE against emulated FP8 numerics, per-parameter cosines, TE's norm +
  # linear alone). The rest of the one-GPU
  # work has run: the FP8 rows at 512K, linear FP8 at 131K rows, #10 scaled to one GPU (qwen3.6-27b
  # at 4 layers, 2.1M prompt, G=2 and G=8: docs/qwen3.6-27b_2m.md) and the DSA tests.
  exec $g queue-start \
    te-tests "$g te-wait 400 && GPU_HOST_TIMEOUT=540 $g run -k transformer_engine"
fi
exec $g queue-start \
  reshard "LONGSTRAW_NO_COMPILE=1 GPU_HOST_TIMEOUT=360 $g train-reshard \"$train\" '--tensor-model-parallel-size 2' '--pipeline-model-parallel-size 2'" \
  pp-test "GPU_TESTS_SPREAD=0 GPU_HOST_TIMEOUT=400 LONGSTRAW_WORKER_STACKS_AFTER=330 $g run -s -o faulthandler_timeout=380 -k pipeline_parallel" \
  te-tests "$g te-wait 400 && CUDA_VISIBLE_DEVICES=0 GPU_TESTS_SPREAD=0 GPU_HOST_TIMEOUT=540 $g run -k transformer_engine" \
  cp2-512k "GPU_HOST_TIMEOUT=240 $g bench-cp 2 $q08 --prompt-lengths 524288 --warmup-prompt-length 524288 --prompt-chunk-size 65536 --tag cp2-512k-c64k" \
  q27b-8l "GPU_HOST_TIMEOUT=480 $g bench-cp 2 --model qwen3.6-27b --num-layers 8 --max-position-embeddings 2097152 \
--modes longstraw --group-sizes 2,8 --response-length 8192 --prompt-lengths 2088960 --warmup-prompt-length 32768 --tag 27b-8l-cp2-2m"
