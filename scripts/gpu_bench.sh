#!/usr/bin/env bash
# The GPU measurements of issue P15 on one NVIDIA GPU (run on an H200), in stages:
#
#   bash scripts/gpu_bench.sh install 'check&' bench              # first call
#   bash scripts/gpu_bench.sh install 'longest&' experiment timed  # second call
#
# A stage named with a trailing '&' runs in the background beside the stages after it (the
# script waits for it at the end).
#
#   install     the repository (`pip install -e .`, no deps) and, with WHEELS=DIR, the wheels there
#               (an offline machine: ml_collections, gguf, reasoning-gym and its requirements)
#   check       scripts/gpu_check.sh as it is: kernel tests compiled by Triton, attention timings
#   bench       replay against the strongest naive GRPO step, bfloat16, SmolLM2-135M's architecture
#               with random weights (the cost does not depend on them), attention_impl pallas and
#               xla, at (P, T, G) = (1024, 128, 8), (8192, 256, 16), (32768, 512, 16); one
#               `branch_replay_jax.benchmarks.replay` process per (case, implementation), all started at once:
#               they compile side by side on the host and take a file lock around their timed runs
#               (config.timing_lock), so no two timings share the GPU. Peak bytes are the device's
#               peak_bytes_in_use of each worker process (one process per mode).
#   experiment  the default experiment (experiments/grpo_smollm2_arith.py, the real SmolLM2-135M-
#               Instruct) for 10 steps; metrics.jsonl gives sample_s, score_s and update_s per step
#   longest     the longest prompt one GPU trains at G = 16, T = 1024 (remat save_kv), replay and
#               naive, by compile-only memory estimates (argument + temp + output bytes against
#               MEMORY_BUDGET, default 130 GiB), then one timed replay step at TIMED_P
#
# Results go to $OUT (default gpu_out/): bench.jsonl, longest.jsonl, experiment_metrics.jsonl and
# one log per stage. XLA_PYTHON_CLIENT_PREALLOCATE=false lets the side-by-side processes share the
# GPU's memory. Each stage's processes are time-boxed (STAGE_TIMEOUT seconds) so one call fits the
# device lease; the exit status is non-zero when any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export BENCH_TIMING_LOCK=${BENCH_TIMING_LOCK:-/tmp/branch_replay_gpu.lock}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-300}
MEMORY_BUDGET=${MEMORY_BUDGET:-$((130 * 1024 ** 3))}
TIMED_P=${TIMED_P:-131072}

bench() {   # bench IMPL P T G REMAT NAIVE_MICRO_BATCH REPEATS: one case, naive then replay, its own log
  timeout "$STAGE_TIMEOUT" "$PY" -m branch_replay_jax.benchmarks.replay --config=experiments/bench_replay.py \
    --config.model=random:smollm2-135m --config.dtype=bfloat16 --config.attention_impl="$1" \
    --config.cases="(($2, $3, $4, '$5'),)" --config.tree_cases="()" --config.ppo_cases="()" \
    --config.naive_micro_batches="$6" --config.replay_micro_batches=G --config.repeats="$7" \
    --config.timing_lock="$BENCH_TIMING_LOCK" --config.output="$OUT/bench.jsonl" > "$OUT/bench_$1_$2.log" 2>&1
}

longest() {   # longest MODE-FLAGS...: compile-only search at G = 16, T = 1024, remat save_kv
  timeout "$STAGE_TIMEOUT" "$PY" -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py \
    --config.model=random:smollm2-135m --config.dtype=bfloat16 --config.attention_impl=pallas \
    --config.studies=longest_context --config.longest_context.G=16 --config.longest_context.T=1024 \
    --config.longest_context.compile_only=True --config.longest_context.start_p=262144 \
    --config.longest_context.granularity=524288 --config.longest_context.max_p=8388608 \
    --config.memory_budget_bytes="$MEMORY_BUDGET" --config.attempt_timeout_s=150 \
    --config.output="$OUT/longest.jsonl" "$@"
}

run_stage() {
  local rc=0 pids=() p
  echo "== $1 start $(date +%T)"
  case "$1" in
    install)
      if [[ -n "${WHEELS:-}" ]]; then "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || rc=1; fi
      "$PY" -m pip install -q --no-deps --no-build-isolation -e . || rc=1
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        "$PY" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
      } > "$OUT/env.txt" 2>&1 || rc=1
      cat "$OUT/env.txt" ;;
    check)   # holds the timing lock throughout: its tests and timings never share the GPU with a timed step
      touch "$BENCH_TIMING_LOCK"
      flock "$BENCH_TIMING_LOCK" env BENCH_TIMING_LOCK= timeout "$STAGE_TIMEOUT" bash scripts/gpu_check.sh \
        > "$OUT/check.log" 2>&1 || rc=1 ;;
    bench)
      bench pallas 1024 128 8 none G 3 & pids+=($!)
      bench xla 1024 128 8 none 2 3 & pids+=($!)            # G at once: 46 GB of dense scores, refused beside the others
      bench pallas 8192 256 16 save_kv G 3 & pids+=($!)
      bench xla 8192 256 16 save_kv 1 3 & pids+=($!)
      bench pallas 32768 512 16 save_kv 4 1 & pids+=($!)
      for p in "${pids[@]}"; do wait "$p" || rc=1; done ;;
    bench_xla_32k)   # the dense reference materialises [Hq, S, S] float32 scores (~40 GB a layer)
      bench xla 32768 512 16 save_kv 1 1 || rc=1 ;;
    experiment)
      timeout "$STAGE_TIMEOUT" "$PY" -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py \
        --config.train.steps=10 --config.checkpoint_every=10 --config.run_dir=/tmp/gpu_default_run --config.overwrite=True \
        > "$OUT/experiment.log" 2>&1 || rc=1
      cp /tmp/gpu_default_run/metrics.jsonl "$OUT/experiment_metrics.jsonl" || rc=1 ;;
    longest)
      longest --config.policies=save_kv --config.naive_policies= > "$OUT/longest_replay.log" 2>&1 & pids+=($!)
      longest --config.policies= --config.naive_policies=save_kv --config.longest_context.naive_micro_batches=1 \
        > "$OUT/longest_naive.log" 2>&1 & pids+=($!)
      for p in "${pids[@]}"; do wait "$p" || rc=1; done ;;
    timed)   # one timed replay step at TIMED_P (G = 16, T = 1024, save_kv)
      timeout "$STAGE_TIMEOUT" "$PY" -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py \
        --config.model=random:smollm2-135m --config.dtype=bfloat16 --config.attention_impl=pallas \
        --config.studies=longest_context --config.policies=save_kv --config.naive_policies= \
        --config.longest_context.G=16 --config.longest_context.T=1024 --config.longest_context.start_p="$TIMED_P" \
        --config.longest_context.max_p="$TIMED_P" --config.attempt_timeout_s="$STAGE_TIMEOUT" \
        --config.output="$OUT/longest.jsonl" > "$OUT/timed.log" 2>&1 || rc=1 ;;
    *) echo "unknown stage $1"; rc=2 ;;
  esac
  echo "== $1 end $(date +%T) rc=$rc"
  return "$rc"
}

status=0 background=()
for stage in "$@"; do
  if [[ "$stage" == *"&" ]]; then
    run_stage "${stage%&}" & background+=($!)
  else
    run_stage "$stage" || status=1
  fi
done
for p in "${background[@]}"; do wait "$p" || status=1; done
pkill -f "branch_replay_jax.benchmarks" 2>/dev/null   # workers orphaned by a timeout
echo "== done $(date +%T), status $status"
exit "$status"
