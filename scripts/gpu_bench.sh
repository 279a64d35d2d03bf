#!/usr/bin/env bash
# GPU measurements on one NVIDIA GPU (written for an H200), in stages, every stage time-boxed.
#
# ONE CALL (issue P18, item 6): with no stage named, the default set runs in under DEADLINE_S
# (540 s) of wall time:
#
#   install  mesh& replay& gap& prompt_attention& attention&     (then `summarize`, always)
#
# When a device is lent: prepare the two wheels the device's image lacks, once, in the checkout's
# root that the session sends (pure Python; the image has their requirements: absl-py, PyYAML,
# numpy, requests, tqdm):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl ml_collections==1.1.0 gguf==0.19.0
#
# then paste this `run` (carry [".whl"], timeout_s 600; the figures come back in $OUT). The device
# tool sends the checkout its session was started in, not a helper's worktree: merge this script's
# branch there first.
#
#   run(command="WHEELS=.whl bash scripts/gpu_bench.sh", carry=[".whl"], timeout_s=600)
#
# and write $OUT/summary.md (markdown tables) with the raw JSONL into docs/results/<study>/.
# The device returns at most 8 files from $OUT; the default set writes exactly 8: env.txt,
# stages.jsonl, replay.jsonl, mesh.jsonl, prompt_attention.jsonl, attention.jsonl, summary.md and
# logs.tar.gz (every process's log).
#
# On the CPU, every stage with tiny shapes (no install; cuDNN skipped or refused with its reason;
# 22 minutes on one shared core, docs/results/gpu-bench-ready):
#
#   SMOKE=1 PYTHON=.venv/bin/python taskset -c 0 bash scripts/gpu_bench.sh
#
# Stages (a name with a trailing '&' runs in the background beside the stages after it; the
# script waits for every one before `summarize`):
#
#   install     the repository (`pip install -e .`, no deps) and, with WHEELS=DIR, the wheels there;
#               env.txt (GPU, driver, JAX/Flax/Optax versions). SMOKE: env.txt only, nothing installed
#   mesh        the mesh code path on one GPU: `gradients.step.value_and_grad(mesh=1x1x1)` through
#               distributed/mesh.py (shard_map, check_vma) with attention_impl pallas (the Triton
#               kernels inside the shard_map), against the one-device step (no mesh; the fused replay)
#               on the same group: loss and gradient difference, step seconds (benchmarks/mesh.py,
#               one_device=True). Two processes: float32 at JAX_DEFAULT_MATMUL_PRECISION=highest (the
#               exactness: rounding only) and bfloat16 (the speed). SmolLM2-135M's shape, random
#               weights, one group of G = 8, P = 1024, T = 128, micro-batch 8
#   replay      replay against naive, bfloat16, attention pallas, SmolLM2-135M's architecture with
#               random weights, (P, T, G) = (1024, 128, 8) remat none, (8192, 256, 16) and
#               (32768, 512, 16) save_kv; ideal_flop_ratio, speedup / ideal, and MFU (model FLOPs by
#               data.counts.forward_flops, x3 for the step, / step seconds / PEAK_TFLOPS, default 989:
#               the H200's dense bf16 peak by NVIDIA's datasheet, experiments/bench_replay.py)
#   gap         what closes P15's 0.37 of ideal at (1024, 128, 8): the same case with the old replay
#               (fused=off: core.replay.replay_vjp), with the prompt's own causal block through
#               jax.nn.dot_product_attention(implementation="cudnn") (prompt_attention=cudnn; SMOKE:
#               xla), and with 32 completions per step (G = 32, micro-batch G: launches amortised)
#   prompt_attention  a 32k-token prompt's causal self-attention, our Triton kernel against cuDNN,
#               forward and forward+backward (benchmarks/prompt_attention.py; Hq:Hkv 32:8, D 128)
#   attention   suffix attention at (S_anc, T) = (32768, 512): our kernel against cuDNN with the
#               explicit suffix mask (benchmarks/attention.py)
#   gated_delta (named only: `bash scripts/gpu_bench.sh install gated_delta`) Qwen3.5's chunked gated delta
#               rule, its chunk scan by jax.lax.scan against the Pallas kernels (model.gated_delta_scan),
#               forward and forward+backward at T = 8192 and 32768, 32 heads of 128 x 128
#               (benchmarks/gated_delta.py; SMOKE: T = 40, the interpreter)
#   summarize   branch_replay_jax.benchmarks.summarize: $OUT/*.jsonl -> $OUT/summary.md (always last)
#
# P15's stages still run when named: check (scripts/gpu_check.sh), bench (P15's replay set, to
# bench.jsonl), bench_xla_32k, experiment, longest, timed, e.g.
#   bash scripts/gpu_bench.sh install 'longest&' experiment timed
#
# Every process's timed runs take one file lock (BENCH_TIMING_LOCK), so processes compile side by
# side on the host but no two timings share the GPU; XLA_PYTHON_CLIENT_PREALLOCATE=false lets them
# share its memory. Each stage's processes get `timeout` min(STAGE_TIMEOUT, what is left of
# DEADLINE_S minus RESERVE_S for summarize); `timeout` kills a process's whole group (its benchmark
# workers too). One line per stage in stages.jsonl; the exit status is non-zero when any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_out}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_bench_logs.XXXXXX")
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export BENCH_TIMING_LOCK=${BENCH_TIMING_LOCK:-$LOGS/timing.lock}
START=$(date +%s)
# the run's timeout_s (600) less start-up and copying back; SMOKE shares one CPU core among ~10 processes
DEADLINE_S=${DEADLINE_S:-$([[ $SMOKE == 1 ]] && echo 2400 || echo 540)}
RESERVE_S=${RESERVE_S:-20}       # kept for summarize and the log archive
STAGE_TIMEOUT=${STAGE_TIMEOUT:-$DEADLINE_S}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
MEMORY_BUDGET=${MEMORY_BUDGET:-$((130 * 1024 ** 3))}
TIMED_P=${TIMED_P:-131072}
touch "$BENCH_TIMING_LOCK"

box() {   # seconds a process started now may run: min(STAGE_TIMEOUT, DEADLINE_S - RESERVE_S - elapsed), >= 1
  local left=$((DEADLINE_S - RESERVE_S - ($(date +%s) - START)))
  ((left > STAGE_TIMEOUT)) && left=$STAGE_TIMEOUT
  ((left < 1)) && left=1
  echo "$left"
}

if [[ "$SMOKE" == 1 ]]; then   # CPU: tiny model, tiny shapes; cuDNN becomes xla where the step needs one
  REPLAY_BASE=(--config=experiments/bench_replay.py:smoke --config.model=tiny --config.dtype=bfloat16
               --config.attention_impl=xla)
  REPLAY_CASES=("24 6 4 none G 2" "32 8 4 save_kv G 2" "48 8 4 save_kv 2 1")
  GAP_CASE="24 6 4 none G 2"; GAP_WIDE="24 6 8 none G 2"; GAP_DPA=xla
  MESH_BASE=(--config=experiments/bench_mesh.py:smoke)
  PROMPT_ATTENTION=(--config=experiments/bench_prompt_attention.py:smoke)
  ATTENTION=(--config=experiments/bench_attention.py:smoke --config.impls=pallas,reference,dpa_cudnn)
  GATED_DELTA=(--config=experiments/bench_gated_delta.py:smoke)
else
  REPLAY_BASE=(--config=experiments/bench_replay.py --config.model=random:smollm2-135m --config.dtype=bfloat16
               --config.attention_impl=pallas)
  # P T G remat naive-micro-batch repeats (P15's naive micro-batches: the largest that fit beside the others)
  REPLAY_CASES=("1024 128 8 none G 3" "8192 256 16 save_kv G 3" "32768 512 16 save_kv 4 1")
  GAP_CASE="1024 128 8 none G 3"; GAP_WIDE="1024 128 32 none G 3"; GAP_DPA=cudnn
  MESH_BASE=(--config=experiments/bench_mesh.py --config.model=random-smollm2-shape --config.attention_impl=pallas
             --config.algorithms=grpo --config.meshes=1x1x1 --config.groups=1 --config.group_size=8
             --config.prompt_len=1024 --config.completion_len=128 --config.micro_batch=8 --config.one_device=True)
  PROMPT_ATTENTION=(--config=experiments/bench_prompt_attention.py)
  ATTENTION=(--config=experiments/bench_attention.py --config.cases=32768:512 --config.impls=pallas,dpa_cudnn)
  GATED_DELTA=(--config=experiments/bench_gated_delta.py)
fi

replay_case() {   # replay_case LOG P T G REMAT NAIVE_MICRO_BATCH REPEATS [OVERRIDE...]: one case, naive then replay
  local log=$1 p=$2 t=$3 g=$4 remat=$5 naive_m=$6 repeats=$7
  shift 7
  timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.replay "${REPLAY_BASE[@]}" \
    --config.cases="(($p, $t, $g, '$remat'),)" --config.tree_cases="()" --config.ppo_cases="()" \
    --config.naive_micro_batches="$naive_m" --config.replay_micro_batches=G --config.repeats="$repeats" \
    --config.peak_tflops="$PEAK_TFLOPS" --config.timing_lock="$BENCH_TIMING_LOCK" --config.output="$OUT/replay.jsonl" \
    "$@" > "$LOGS/$log.log" 2>&1
}

bench() {   # P15: bench IMPL P T G REMAT NAIVE_MICRO_BATCH REPEATS: one case, naive then replay, its own log
  timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.replay --config=experiments/bench_replay.py \
    --config.model=random:smollm2-135m --config.dtype=bfloat16 --config.attention_impl="$1" \
    --config.cases="(($2, $3, $4, '$5'),)" --config.tree_cases="()" --config.ppo_cases="()" \
    --config.naive_micro_batches="$6" --config.replay_micro_batches=G --config.repeats="$7" \
    --config.timing_lock="$BENCH_TIMING_LOCK" --config.output="$OUT/bench.jsonl" > "$LOGS/bench_$1_$2.log" 2>&1
}

longest() {   # P15: longest MODE-FLAGS...: compile-only search at G = 16, T = 1024, remat save_kv
  timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py \
    --config.model=random:smollm2-135m --config.dtype=bfloat16 --config.attention_impl=pallas \
    --config.studies=longest_context --config.longest_context.G=16 --config.longest_context.T=1024 \
    --config.longest_context.compile_only=True --config.longest_context.start_p=262144 \
    --config.longest_context.granularity=524288 --config.longest_context.max_p=8388608 \
    --config.memory_budget_bytes="$MEMORY_BUDGET" --config.attempt_timeout_s=150 \
    --config.output="$OUT/longest.jsonl" "$@"
}

wait_all() {   # wait_all PID...: 0 when all exited 0, 124 when any ran past its time box, else 1
  local rc=0 p s
  for p in "$@"; do
    wait "$p"; s=$?
    if ((s == 124 || s == 137)); then rc=124; elif ((s != 0 && rc == 0)); then rc=1; fi
  done
  return "$rc"
}

run_stage() {
  local rc=0 pids=() t0 c box0
  t0=$(date +%s) box0=$(box)
  echo "== $1 start $(date +%T) (time box $box0 s)"
  case "$1" in
    install)
      if [[ "$SMOKE" != 1 ]]; then
        if [[ -n "${WHEELS:-}" ]]; then "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || rc=1; fi
        "$PY" -m pip install -q --no-deps --no-build-isolation -e . || rc=1
      fi
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
        "$PY" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
      } > "$OUT/env.txt" 2>&1 || rc=1
      cat "$OUT/env.txt" ;;
    mesh)   # float32 (exactness, full-precision matmuls) and bfloat16 (speed), side by side
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.mesh \
        "${MESH_BASE[@]}" --config.dtype=float32 --config.output="$OUT/mesh.jsonl" > "$LOGS/mesh_float32.log" 2>&1 &
      pids+=($!)
      timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.mesh "${MESH_BASE[@]}" --config.dtype=bfloat16 \
        --config.output="$OUT/mesh.jsonl" > "$LOGS/mesh_bfloat16.log" 2>&1 &
      pids+=($!)
      wait_all "${pids[@]}" || rc=$? ;;
    replay)
      for c in "${REPLAY_CASES[@]}"; do
        read -r p t g remat m n <<< "$c"
        replay_case "replay_${p}_${t}_${g}" "$p" "$t" "$g" "$remat" "$m" "$n" & pids+=($!)
      done
      wait_all "${pids[@]}" || rc=$? ;;
    gap)   # the (1024, 128, 8) case's variants; its default (fused, the model's attention) is the replay stage's row
      read -r p t g remat m n <<< "$GAP_CASE"
      replay_case gap_replay_vjp "$p" "$t" "$g" "$remat" "$m" "$n" --config.fused=off & pids+=($!)
      replay_case "gap_prompt_$GAP_DPA" "$p" "$t" "$g" "$remat" "$m" "$n" --config.prompt_attention="$GAP_DPA" & pids+=($!)
      read -r p t g remat m n <<< "$GAP_WIDE"
      replay_case "gap_G$g" "$p" "$t" "$g" "$remat" "$m" "$n" & pids+=($!)
      wait_all "${pids[@]}" || rc=$? ;;
    prompt_attention)
      timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.prompt_attention "${PROMPT_ATTENTION[@]}" \
        --config.output="$OUT/prompt_attention.jsonl" > "$LOGS/prompt_attention.log" 2>&1 || rc=$? ;;
    attention)
      timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.attention "${ATTENTION[@]}" \
        --config.output="$OUT/attention.jsonl" > "$LOGS/attention.log" 2>&1 || rc=$? ;;
    gated_delta)
      timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.gated_delta "${GATED_DELTA[@]}" \
        --config.output="$OUT/gated_delta.jsonl" > "$LOGS/gated_delta.log" 2>&1 || rc=$? ;;
    check)   # P15; holds the timing lock throughout: its tests and timings never share the GPU with a timed step
      flock "$BENCH_TIMING_LOCK" env BENCH_TIMING_LOCK= timeout "$(box)" bash scripts/gpu_check.sh \
        > "$LOGS/check.log" 2>&1 || rc=$? ;;
    bench)   # P15's replay set (pallas and xla rows) to bench.jsonl
      bench pallas 1024 128 8 none G 3 & pids+=($!)
      bench xla 1024 128 8 none 2 3 & pids+=($!)            # G at once: 46 GB of dense scores, refused beside the others
      bench pallas 8192 256 16 save_kv G 3 & pids+=($!)
      bench xla 8192 256 16 save_kv 1 3 & pids+=($!)
      bench pallas 32768 512 16 save_kv 4 1 & pids+=($!)
      wait_all "${pids[@]}" || rc=$? ;;
    bench_xla_32k)   # the dense reference materialises [Hq, S, S] float32 scores (~40 GB a layer)
      bench xla 32768 512 16 save_kv 1 1 || rc=$? ;;
    experiment)
      timeout "$(box)" "$PY" -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py \
        --config.train.steps=10 --config.checkpoint_every=10 --config.run_dir=/tmp/gpu_default_run --config.overwrite=True \
        > "$LOGS/experiment.log" 2>&1 || rc=$?
      cp /tmp/gpu_default_run/metrics.jsonl "$OUT/experiment_metrics.jsonl" || rc=1 ;;
    longest)
      longest --config.policies=save_kv --config.naive_policies= > "$LOGS/longest_replay.log" 2>&1 & pids+=($!)
      longest --config.policies= --config.naive_policies=save_kv --config.longest_context.naive_micro_batches=1 \
        > "$LOGS/longest_naive.log" 2>&1 & pids+=($!)
      wait_all "${pids[@]}" || rc=$? ;;
    timed)   # P15: one timed replay step at TIMED_P (G = 16, T = 1024, save_kv)
      timeout "$(box)" "$PY" -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py \
        --config.model=random:smollm2-135m --config.dtype=bfloat16 --config.attention_impl=pallas \
        --config.studies=longest_context --config.policies=save_kv --config.naive_policies= \
        --config.longest_context.G=16 --config.longest_context.T=1024 --config.longest_context.start_p="$TIMED_P" \
        --config.longest_context.max_p="$TIMED_P" --config.attempt_timeout_s="$(box)" \
        --config.output="$OUT/longest.jsonl" > "$LOGS/timed.log" 2>&1 || rc=$? ;;
    *) echo "unknown stage $1"; rc=2 ;;
  esac
  local seconds=$(($(date +%s) - t0)) timed_out=false
  ((rc == 124 || rc == 137)) && timed_out=true
  printf '{"stage": "%s", "rc": %d, "seconds": %d, "timeout_s": %d, "timed_out": %s, "smoke": %s}\n' \
    "$1" "$rc" "$seconds" "$box0" "$timed_out" "$([[ $SMOKE == 1 ]] && echo true || echo false)" \
    >> "$OUT/stages.jsonl"
  echo "== $1 end $(date +%T) rc=$rc (${seconds} s)"
  return "$rc"
}

stages=("$@")
if ((${#stages[@]} == 0)); then stages=(install 'mesh&' 'replay&' 'gap&' 'prompt_attention&' 'attention&'); fi
status=0 background=()
for stage in "${stages[@]}"; do
  if [[ "$stage" == *"&" ]]; then
    run_stage "${stage%&}" & background+=($!)
  else
    run_stage "$stage" || status=1
  fi
done
for p in "${background[@]}"; do wait "$p" || status=1; done
"$PY" -m branch_replay_jax.benchmarks.summarize "$OUT" --output "$OUT/summary.md" > /dev/null 2> "$LOGS/summarize.log" \
  || { status=1; cat "$LOGS/summarize.log"; }
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude=timing.lock . && rm -rf "$LOGS"
echo "== done $(date +%T) after $(($(date +%s) - START)) s, status $status; tables in $OUT/summary.md"
exit "$status"
