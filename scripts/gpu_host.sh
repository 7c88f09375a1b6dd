#!/usr/bin/env bash
# The GPU-host runner (offline H200, Python 3.12 + torch preinstalled). A call to the host carries
# at most 64 MiB, so the wheels travel in two consecutive calls while the machine stays warm:
#   call 1 (carry .whl-a, .gpu-cache/kernels.sha256, .gpu-cache/kernels.tgz.part-ab):
#       bash scripts/gpu_host.sh install-a
#   call 2 (carry .whl-b, .gpu-cache/kernels.sha256, .gpu-cache/kernels.tgz.part-aa):
#       bash scripts/gpu_host.sh run [pytest -k EXPR ...]
#   later calls (nothing carried):
#       bash scripts/gpu_host.sh bench [tools/bench_longstraw.py args ...]
#       bash scripts/gpu_host.sh bench-with-tests [bench args ...]
#       bash scripts/gpu_host.sh bench-cp N [bench args ...]   (N GPUs, context parallel size N)
#       bash scripts/gpu_host.sh bench-pp N [bench args ...]   (N GPUs, N pipeline stages)
#       bash scripts/gpu_host.sh train [train_grpo.py args ...]
#       bash scripts/gpu_host.sh py SCRIPT [args ...]             (python3 with the host's paths)
#       bash scripts/gpu_host.sh train-sweep "COMMON ARGS" NAME "ARGS" [NAME "ARGS" ...]
#       bash scripts/gpu_host.sh train-reshard "COMMON ARGS" "FIRST LAYOUT" "RESUMED LAYOUT"
#       bash scripts/gpu_host.sh batch NAME "COMMAND" [NAME "COMMAND" ...]
#       bash scripts/gpu_host.sh queue-start NAME "COMMAND" [...]   (a batch that outlives the call)
#       bash scripts/gpu_host.sh queue-wait [SECONDS]               (its progress so far, or its end)
# Transformer Engine (its source and build script split into .te-1 ... .te-6 here): one call per
# piece while the machine stays warm, carrying .te-N alone (each is up to 56 MiB):
#       bash scripts/gpu_host.sh te-piece          (carry .te-1, then .te-2, ... .te-5)
#       bash scripts/gpu_host.sh te-build          (carry .te-6: joins, installs, compiles ~2 min)
# afterwards every verb puts /tmp/te-site on PYTHONPATH.
# On a host of several GPUs, verbs run side by side with CUDA_VISIBLE_DEVICES and OUT=$OUT/NAME
# each (install .whl-b first with `install-b` so that they do not race on it).
# `run` installs .whl-b when carried, runs the GPU test tier (tests/gpu), prints a table.
# `bench` runs the LongStraw benchmark into $OUT/bench (copy it into docs/ afterwards).
# `bench-with-tests` runs the GPU test tier in the background while the benchmark runs: the
# benchmark's times are then upper bounds (use it for thresholds, not for ratios).
# `train` runs train_grpo.py into $OUT/train (metrics.jsonl and learning_curve.png).
# `train-reshard` runs train_grpo.py under torchrun on every GPU with the first layout's parallel
# args (e.g. "--tensor-model-parallel-size 2") for --train-iters steps with a checkpoint, then
# resumes it with the second layout for two more steps (Megatron's checkpoints reshard).
# `batch` runs several commands one after another in one call (each a shell command, e.g.
# "GPU_TESTS_SPREAD=0 GPU_HOST_TIMEOUT=200 bash scripts/gpu_host.sh run -s -k context_parallel"),
# each with OUT=$OUT/NAME and its output in NAME.log, prints each one's tail, and returns them all
# as $OUT/batch.tgz (a call returns at most 8 files), plus the kernel cache pieces.
# `queue-start` runs such a batch in its own process session from a snapshot of the tree, so it
# goes on between calls while the machine stays warm (a call every < 30 s: e.g. the te-piece
# calls); `queue-wait` waits up to SECONDS for its end and returns what it has so far as
# $OUT/queue.tgz (logs and outputs), with the batch's archive and kernel cache once it ended.
# An item that needs Transformer Engine starts with `bash scripts/gpu_host.sh te-wait SECONDS &&`.
# `train-sweep` runs several train_grpo.py side by side (common args + each NAME's args), spread
# round-robin over the visible GPUs, plots each, prints a table, and returns $OUT/train-sweep.tgz
# (train-NAME/metrics.jsonl, log.txt, learning_curve.png).
# Wheels: docs/development.md (A GPU host without package access).
#
# Kernel cache: a fresh host spends ~4 minutes compiling and autotuning fla's Triton and tilelang
# kernels for each new shape. Triton keeps autotuning results on disk (TRITON_CACHE_AUTOTUNING,
# fla's FLA_CACHE_RESULTS), so later processes on a warm host reuse them. Every verb but
# install-a leaves the caches in $OUT as kernels.tgz.part-aa, -ab, ... (15 MiB pieces, at most
# 3). Here, `bash scripts/gpu_host.sh keep-cache DIR` copies them from DIR into .gpu-cache/ with
# a checksum list; sent with a fresh host's first calls (pieces spread over the calls,
# beside the wheels), they are restored on the host once every listed piece has arrived.
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/site
kcache=/tmp/kcache
limit=${GPU_HOST_TIMEOUT:-540}  # seconds for pytest / the benchmark, inside a call's 600 s limit
export TRITON_CACHE_DIR=$kcache/triton TILELANG_CACHE_DIR=$kcache/tilelang TRITON_CACHE_AUTOTUNING=1
out=${OUT:-/tmp/gpu-host-out}
mkdir -p "$out"
install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$1"/*.whl
  touch "$site/.installed-$(basename "$1")"
}
parts=/tmp/kernel-parts  # pieces of the cache gathered over the calls of one warm host
restore_cache() {
  mkdir -p $parts
  cp .gpu-cache/kernels.sha256 .gpu-cache/kernels.tgz.part-* $parts/ 2>/dev/null || true
  [ -f $parts/kernels.sha256 ] && [ ! -d $kcache ] || return 0
  if (cd $parts && sha256sum --quiet -c kernels.sha256 >/dev/null 2>&1); then
    mkdir -p $kcache
    if cat $parts/kernels.tgz.part-* | tar xz -C $kcache 2>/dev/null; then
      echo "kernel cache restored"
    else  # e.g. an archive cut short when it was saved: compile anew rather than fail the call
      rm -rf $kcache && echo "kernel cache unreadable: not restored"
    fi
  fi
}
keep_cache() {  # here: pieces from a call's returned files into .gpu-cache/, with their checksums
  local from=${1:?usage: bash scripts/gpu_host.sh keep-cache DIR}
  compgen -G "$from/kernels.tgz.part-*" >/dev/null || { echo "no kernels.tgz.part-* in $from" >&2; exit 2; }
  rm -rf .gpu-cache && mkdir -p .gpu-cache && cp "$from"/kernels.tgz.part-* .gpu-cache/
  chmod u+w .gpu-cache/*
  (cd .gpu-cache && sha256sum kernels.tgz.part-* >kernels.sha256)
  ls -l .gpu-cache
}
save_cache() {
  [ -d $kcache ] || return 0
  rm -f "$out"/kernels.tgz.part-*
  tar cz -C $kcache . 2>/dev/null | split -b 15M -a 2 - "$out/kernels.tgz.part-" || return 0
  if [ "$(ls "$out"/kernels.tgz.part-* | wc -l)" -gt 3 ]; then
    echo "kernel cache over 45 MiB: not returned"; rm -f "$out"/kernels.tgz.part-*
  fi
}
# every verb but install-a: second wheel folder if carried, import paths, the kernel cache on exit
prepare() {
  trap save_cache EXIT
  # one cuDNN per process: torch's bundled one, also for Transformer Engine, which loads CUDNN_HOME's
  # or else the loader's (a system cuDNN beside torch's breaks cuDNN's FP8 attention)
  local cudnn_dir
  cudnn_dir=$(python3 -c "import nvidia.cudnn as m; print(list(m.__path__)[0])" 2>/dev/null || true)
  if [ -n "$cudnn_dir" ] && [ -d "$cudnn_dir/lib" ]; then
    export CUDNN_HOME=$cudnn_dir LD_LIBRARY_PATH=$cudnn_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  if [ -d .whl-b ] && [ ! -f $site/.installed-.whl-b ]; then install .whl-b; fi
  export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  if [ -d /tmp/te-site ]; then export PYTHONPATH=/tmp/te-site:$PYTHONPATH; fi
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
}
gpu_tests() {  # pytest args; junit XML and log into $out, then the table
  local ngpu spread=()
  ngpu=$(nvidia-smi -L | wc -l)
  # several GPUs: one pytest-xdist worker per GPU (tests/conftest.py pins each worker's GPU)
  # (GPU_TESTS_SPREAD=0: one process that sees every GPU, for the tests that need two)
  if [ "$ngpu" -gt 1 ] && [ "${GPU_TESTS_SPREAD:-1}" = 1 ]; then
    spread=(-n "$ngpu" --dist loadfile); export LONGSTRAW_TEST_GPUS=$ngpu
  fi
  # Megatron's torch.compile'd helpers run eagerly in the tests: each spawned rank would compile
  # them anew for every shape (patches/no_compile.py); benchmarks and training keep them compiled
  export LONGSTRAW_NO_COMPILE=1
  set +e
  timeout "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider --durations=15 "${spread[@]}" \
    --junitxml="$out/gpu-tests.xml" tests/gpu "$@" >"$out/gpu-tests.log" 2>&1
  local status=$?
  set -e
  tail -n 30 "$out/gpu-tests.log"
  python3 tools/gpu_summary.py "$out/gpu-tests.xml" || true
  return $status
}
bench() {  # bench_longstraw.py args
  timeout "$limit" python3 tools/bench_longstraw.py --output-dir "$out/bench" "$@" 2>&1 | grep -v -i "warn\|deprecated"
}
bench_parallel() {  # flag, N, then bench_longstraw.py args: one rank per GPU
  local flag=$1 n=$2; shift 2
  timeout "$limit" python3 -m torch.distributed.run --nproc_per_node "$n" tools/bench_longstraw.py \
    "$flag" "$n" --output-dir "$out/bench" "$@" 2>&1 | grep -v -i "warn\|deprecated"
}
case "${1:-}" in
  keep-cache) keep_cache "${2:-}"; exit 0 ;;
esac
restore_cache
case "${1:-}" in
  install-a) install .whl-a; echo "installed .whl-a into $site" ;;
  run) shift; prepare; gpu_tests "$@" ;;
  bench) shift; prepare; bench "$@" ;;
  py) shift; prepare; timeout "$limit" python3 "$@" ;;
  bench-cp) shift; prepare; bench_parallel --context-parallel-size "$@" ;;
  bench-pp) shift; prepare; bench_parallel --pipeline-model-parallel-size "$@" ;;
  bench-with-tests)
    shift; prepare
    gpu_tests >/dev/null 2>&1 &
    tests_pid=$!
    bench "$@" || true
    set +e; wait $tests_pid; status=$?; set -e
    tail -n 5 "$out/gpu-tests.log"; python3 tools/gpu_summary.py "$out/gpu-tests.xml" || true
    exit $status ;;
  install-b) install .whl-b; echo "installed .whl-b into $site" ;;
  install-c) install .whl-c; echo "installed .whl-c into $site" ;;  # optional: the cuDNN frontend (--fp8-attention)
  te-piece) mkdir -p /tmp/te; for d in .te-[1-5]; do if [ -d "$d" ]; then cp "$d"/* /tmp/te/; fi; done; ls /tmp/te ;;
  te-build) bash .te-6/build-te.sh && touch /tmp/te-site/.ready ;;
  te-wait)  # until te-build has finished (for queued items), at most $2 seconds
    end=$((SECONDS + ${2:-600}))
    until [ -f /tmp/te-site/.ready ]; do
      [ $SECONDS -lt "$end" ] || { echo "Transformer Engine not built within ${2:-600} s" >&2; exit 1; }
      sleep 5
    done ;;
  queue-start)
    shift; q=/tmp/queue; rm -rf $q; mkdir -p $q/repo $q/out
    tar c --exclude='./.te-*' --exclude='./.whl-*' --exclude=./.git . | tar x -C $q/repo
    (cd $q/repo && OUT=$q/out setsid nohup bash scripts/gpu_host.sh batch "$@" >$q/queue.log 2>&1 </dev/null &)
    echo "queue started: $(($# / 2)) items" ;;
  queue-wait)
    q=/tmp/queue; end=$((SECONDS + ${2:-540}))
    until [ -f $q/out/batch.tgz ] || [ $SECONDS -ge "$end" ]; do sleep 5; done
    tail -n 40 $q/queue.log
    if [ -f $q/out/batch.tgz ]; then cp $q/out/batch.tgz $q/out/kernels.tgz.part-* "$out"/ 2>/dev/null || true
    else (cd $q && tar czf "$out/queue.tgz" --exclude='kernels.tgz.part-*' queue.log out); fi ;;
  train-sweep)
    shift; prepare
    common=${1:?usage: train-sweep "COMMON ARGS" NAME "ARGS" ...}; shift
    ngpu=$(nvidia-smi -L | wc -l); i=0; names=(); declare -A own_args
    while [ $# -ge 2 ]; do
      name=$1 own=$2; shift 2; names+=("$name"); own_args[$name]=$own; mkdir -p "$out/train-$name"
      # shellcheck disable=SC2086  # the args are word lists on purpose
      CUDA_VISIBLE_DEVICES=$((i % ngpu)) timeout "$limit" python3 train_grpo.py --no-save \
        --wandb-save-dir "$out/train-$name" --log-interval 10 $common $own >"$out/train-$name/log.txt" 2>&1 &
      i=$((i + 1))
    done
    set +e; wait; set -e
    for name in "${names[@]}"; do
      echo "== $name: $(grep -E '^step|Error' "$out/train-$name/log.txt" | tail -n 1)"
      python3 tools/plot_metrics.py "$out/train-$name/metrics.jsonl" --keys reward/mean,entropy/mean \
        --output "$out/train-$name/learning_curve.png" --title "train_grpo.py $common ${own_args[$name]}" || true
    done
    # a call returns at most 8 files: the runs' metrics, logs and plots travel as one archive
    (cd "$out" && tar czf train-sweep.tgz train-*/metrics.jsonl train-*/log.txt train-*/learning_curve.png \
      && rm -rf train-*/) || true ;;
  batch)
    shift; names=()
    while [ $# -ge 2 ]; do
      name=$1 cmd=$2; shift 2; names+=("$name"); mkdir -p "$out/$name"
      echo "== $name: $cmd"
      set +e
      OUT=$out/$name bash -c "$cmd" >"$out/$name.log" 2>&1
      echo "exit status $?" >>"$out/$name.log"
      set -e
      tail -n 12 "$out/$name.log"
    done
    find "$out" -mindepth 2 -name 'kernels.tgz.part-*' -delete
    (cd "$out" && tar czf batch.tgz "${names[@]}" "${names[@]/%/.log}" && rm -rf "${names[@]}" "${names[@]/%/.log}")
    save_cache ;;
  train-reshard)
    shift; prepare
    common=${1:?usage: train-reshard "COMMON ARGS" "FIRST LAYOUT" "RESUMED LAYOUT"} first=$2 resumed=$3
    ngpu=$(nvidia-smi -L | wc -l); ckpt=/tmp/reshard-ckpt; rm -rf $ckpt; mkdir -p "$out/reshard"
    iters=$(echo "$common" | sed -n 's/.*--train-iters \([0-9]*\).*/\1/p')
    set +e
    # shellcheck disable=SC2086  # the args are word lists on purpose
    timeout "$limit" python3 -m torch.distributed.run --nproc_per_node "$ngpu" train_grpo.py $common $first \
      --save $ckpt --save-interval "$iters" --wandb-save-dir "$out/reshard/first" --log-interval 1 \
      2>&1 | tee "$out/reshard/first.log" | grep -v -i "warn\|deprecated" | grep -E "^step|Error|error|saved|iteration" | tail -n 20
    first_status=${PIPESTATUS[0]}
    # (124: killed by the GPU_HOST_TIMEOUT limit, e.g. while kernels compile for new shapes)
    echo "first layout: exit status $first_status (limit $limit s)"
    # shellcheck disable=SC2086
    timeout "$limit" python3 -m torch.distributed.run --nproc_per_node "$ngpu" train_grpo.py \
      ${common/--train-iters $iters/--train-iters $((iters + 2))} $resumed --load $ckpt --no-save \
      --wandb-save-dir "$out/reshard/resumed" --log-interval 1 \
      2>&1 | tee "$out/reshard/resumed.log" | grep -v -i "warn\|deprecated" | grep -E "^step|Error|error|load|iteration" | tail -n 20
    status=${PIPESTATUS[0]}
    echo "resumed layout: exit status $status (limit $limit s)"
    set -e
    [ "$first_status" -eq 0 ] || exit "$first_status"
    exit "$status" ;;
  train)
    shift; prepare
    mkdir -p "$out/train"
    set +e
    timeout "$limit" python3 train_grpo.py --no-save --wandb-save-dir "$out/train" --log-interval 10 "$@" 2>&1 \
      | grep -v -i "warn\|deprecated"
    status=${PIPESTATUS[0]}
    set -e
    python3 tools/plot_metrics.py "$out/train/metrics.jsonl" --keys reward/mean,entropy/mean \
      --output "$out/train/learning_curve.png" --title "train_grpo.py $*" || true
    exit "$status" ;;
  *) echo "usage: bash scripts/gpu_host.sh install-a | install-b | install-c | te-piece | te-build | te-wait S | run [pytest args] | keep-cache DIR | bench [args] | bench-with-tests [args] | bench-cp N [args] | bench-pp N [args] | py SCRIPT [args] | train [args] | train-sweep COMMON NAME ARGS ... | train-reshard COMMON FIRST RESUMED | batch NAME COMMAND ... | queue-start NAME COMMAND ... | queue-wait [S]" >&2
     exit 2 ;;
esac
