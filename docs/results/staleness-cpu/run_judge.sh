#!/usr/bin/env bash
# The default experiment scored by remote_judge.py (3 s of host-side waiting per prompt) at
# train.max_staleness = 0 and 1, one after another on the same two cores, no held-out evaluation (it would
# call the judge 9 times per problem). Usage: bash run_judge.sh OUT_DIR [STEPS]
set -euo pipefail
out=${1:?OUT_DIR}; steps=${2:-15}
mkdir -p "$out"
for k in 0 1; do
  /usr/bin/time -f '{"k": '$k', "user_s": %U, "sys_s": %S, "wall_s": %e, "max_rss_kb": %M}' -o "$out/time_k$k.json" \
    taskset -c 0,1 python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py \
      --config.train.steps="$steps" --config.eval.size=0 --config.train.max_staleness=$k \
      --config.task.format_bonus=0.0 \
      --config.task.rewards='("docs/results/staleness-cpu/remote_judge.py:exact_match_after_latency",)' \
      --config.run_dir="$out/k$k" > "$out/k$k.log" 2>&1
done
python -m branch_replay_jax.outputs.compare --runs=k0="$out/k0",k1="$out/k1" --out="$out/judge.png" || true   # (no eval.jsonl: the phase table)
cat "$out"/time_k*.json
