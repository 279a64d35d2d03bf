#!/usr/bin/env bash
# The default experiment at train.max_staleness = 0, 1, 2, one after another on the same two cores
# (nothing else running), then the side-by-side table and figure. Usage: bash run.sh OUT_DIR [STEPS]
set -euo pipefail
out=${1:?OUT_DIR}; steps=${2:-30}
mkdir -p "$out"
for k in 0 1 2; do
  /usr/bin/time -f '{"k": '$k', "user_s": %U, "sys_s": %S, "wall_s": %e, "max_rss_kb": %M}' -o "$out/time_k$k.json" \
    taskset -c 0,1 python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py \
      --config.train.steps="$steps" --config.train.max_staleness=$k --config.run_dir="$out/k$k" > "$out/k$k.log" 2>&1
done
python -m branch_replay_jax.outputs.compare --runs=k0="$out/k0",k1="$out/k1",k2="$out/k2" --out="$out/staleness.png"
cat "$out"/time_k*.json
