#!/usr/bin/env bash
# The pending GPU work of the open issues, as one queue on a two-GPU host (nvidia-h200-x2), in
# priority order (what runs out of device time is at the end). After install-a and install-b:
#   bash scripts/gpu_queue.sh            (starts the queue and returns; see gpu_host.sh queue-*)
# then the Transformer Engine calls (te-piece x5, te-build) while it runs, then
#   bash scripts/gpu_host.sh queue-wait 560   (until it ends; each call returns what it has)
# Each item's output lands in NAME/ and NAME.log of the returned archive. The last item is #10's
# run scaled to two GPUs: qwen3.6-27b's widths at 8 of its 64 layers, the full 2.1M-token prompt
# over CP=2, G=2 and G=8 (the peak difference, and per-layer times to extrapolate to 8 GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
g="bash scripts/gpu_host.sh"
q08="--model qwen3.5-0.8b --max-position-embeddings 2200000 --modes longstraw --group-sizes 8"
train="--hf-config examples/configs/qwen3.5-retrieval-small.json --bf16 --synthetic-prompt-length 32768 \
--synthetic-num-records 1 --max-response-length 4 --num-generations 8 --global-batch-size 8 \
--replay-micro-batch-size 8 --lr 1e-3 --train-iters 3"
te="--transformer-impl transformer_engine"
exec $g queue-start \
  reshard "GPU_HOST_TIMEOUT=200 $g train-reshard \"$train\" '--tensor-model-parallel-size 2' '--pipeline-model-parallel-size 2'" \
  pp-test "GPU_TESTS_SPREAD=0 GPU_HOST_TIMEOUT=400 LONGSTRAW_WORKER_STACKS_AFTER=330 $g run -s -o faulthandler_timeout=380 -k pipeline_parallel" \
  dsa-te-tests "CUDA_VISIBLE_DEVICES=0 GPU_TESTS_SPREAD=0 GPU_HOST_TIMEOUT=250 OUT=\$OUT/dsa $g run -k 'dsa and not transformer_engine' & \
$g te-wait 400 && CUDA_VISIBLE_DEVICES=1 GPU_TESTS_SPREAD=0 GPU_HOST_TIMEOUT=300 OUT=\$OUT/te $g run -k transformer_engine; wait" \
  te-bench "$g te-wait 60 && { CUDA_VISIBLE_DEVICES=0 GPU_HOST_TIMEOUT=300 $g bench $q08 --prompt-lengths 524288 $te --fp8-format hybrid --tag te-fp8-512k; \
CUDA_VISIBLE_DEVICES=0 GPU_HOST_TIMEOUT=300 $g bench $q08 --prompt-lengths 524288 $te --fp8-format hybrid --fp8-recipe tensorwise --tag te-fp8cs-512k; } & \
{ CUDA_VISIBLE_DEVICES=1 GPU_HOST_TIMEOUT=300 $g bench $q08 --prompt-lengths 524288 --tag local-512k; \
for n in 32768 131072; do CUDA_VISIBLE_DEVICES=1 $g py tools/bench_linear_fp8.py --model qwen3.5-0.8b --tokens \$n --fp8-format hybrid --output-dir \$OUT/bench --tag 0.8b-\$n; done; } ; wait" \
  cp2-512k "GPU_HOST_TIMEOUT=240 $g bench-cp 2 $q08 --prompt-lengths 524288 --warmup-prompt-length 524288 --prompt-chunk-size 65536 --tag cp2-512k-c64k" \
  q27b-8l "GPU_HOST_TIMEOUT=480 $g bench-cp 2 --model qwen3.6-27b --num-layers 8 --max-position-embeddings 2097152 \
--modes longstraw --group-sizes 2,8 --response-length 8192 --prompt-lengths 2088960 --warmup-prompt-length 32768 --tag 27b-8l-cp2-2m"
