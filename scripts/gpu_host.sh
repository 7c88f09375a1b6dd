#!/usr/bin/env bash
# The GPU-host runner (offline H200, Python 3.12 + torch preinstalled). A device call carries at
# most 64 MiB, so the wheels travel in two consecutive calls while the machine stays warm:
#   call 1 (carry .whl-a):  bash scripts/gpu_host.sh install-a
#   call 2 (carry .whl-b):  bash scripts/gpu_host.sh run [pytest -k EXPR ...]
#   later calls:            bash scripts/gpu_host.sh bench [tools/bench_longstraw.py args ...]
#                           bash scripts/gpu_host.sh train [train_grpo.py args ...]
# `run` installs .whl-b, runs the GPU test tier (tests marked gpu), then prints a short table.
# `bench` runs the LongStraw benchmark into $OUT/bench (copy it into docs/ afterwards).
# Wheels come from ../shared/offline-gpu/fetch-wheels.sh, run here in the repo root.
#
# Kernel cache: a fresh host spends ~4 minutes compiling and autotuning fla's Triton and tilelang
# kernels per process. `run` and `bench` leave the caches as $OUT/kernels.tar.gz (when it is
# under 15 MiB); copy it to .gpu-cache/kernels.tar.gz here and carry .gpu-cache with a later
# session's calls: every verb restores it before anything compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/site
kcache=/tmp/kcache
limit=${GPU_HOST_TIMEOUT:-540}  # seconds for pytest / the benchmark, inside a device call's 600
export TRITON_CACHE_DIR=$kcache/triton TILELANG_CACHE_DIR=$kcache/tilelang
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$1"/*.whl; }
restore_cache() {
  if [ -f .gpu-cache/kernels.tar.gz ] && [ ! -d $kcache ]; then
    mkdir -p $kcache && tar xzf .gpu-cache/kernels.tar.gz -C $kcache && echo "kernel cache restored"
  fi
}
save_cache() {
  [ -d $kcache ] && [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/kernels.tar.gz" -C $kcache . 2>/dev/null || return 0
  if [ "$(stat -c %s "$OUT/kernels.tar.gz")" -gt $((15 * 2**20)) ]; then
    echo "kernel cache over 15 MiB: not returned"; rm -f "$OUT/kernels.tar.gz"
  fi
}
# run/bench/train: second wheel folder if carried, import paths, and the kernel cache back on exit
prepare() {
  trap save_cache EXIT
  if [ -d .whl-b ]; then install .whl-b; fi
  export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  if [ -d /tmp/te-site ]; then export PYTHONPATH=/tmp/te-site:$PYTHONPATH; fi
}
restore_cache
case "${1:-}" in
  install-a) install .whl-a; echo "installed .whl-a into $site" ;;
  run)
    shift
    prepare
    out=${OUT:-/tmp}
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    set +e
    timeout "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$out/gpu-tests.xml" tests "$@" 2>&1 | tee "$out/gpu-tests.log"
    status=${PIPESTATUS[0]}
    set -e
    python3 tools/gpu_summary.py "$out/gpu-tests.xml"
    exit "$status" ;;
  bench)
    shift
    prepare
    timeout "$limit" python3 tools/bench_longstraw.py --output-dir "${OUT:-/tmp}/bench" "$@" 2>&1 | grep -v -i "warn\|deprecated" ;;
  train)
    shift
    prepare
    out=${OUT:-/tmp}/train
    mkdir -p "$out"
    set +e
    timeout "$limit" python3 train_grpo.py --no-save --wandb-save-dir "$out" --log-interval 10 "$@" 2>&1 \
      | grep -v -i "warn\|deprecated"
    status=${PIPESTATUS[0]}
    set -e
    python3 tools/plot_metrics.py "$out/metrics.jsonl" --keys reward/mean,entropy/mean \
      --output "$out/learning_curve.png" --title "train_grpo.py $*" || true
    exit "$status" ;;
  *) echo "usage: bash scripts/gpu_host.sh install-a | run [pytest args] | bench [bench args] | train [args]" >&2; exit 2 ;;
esac
