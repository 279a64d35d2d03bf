#!/usr/bin/env bash
# The runs of README.md beside this file, one after another on the same two cores (nothing else running),
# then the side-by-side table (and, with held-out evaluations, the figure).
#   bash run.sh default OUT_DIR [STEPS=30]   the default experiment at train.max_staleness = 0, 1, 2
#   bash run.sh judge OUT_DIR [STEPS=15]     scored by remote_judge.py (3 s of waiting per prompt), k = 0, 1,
#                                            no evaluation (it would call the judge 9 times per problem)
#   bash run.sh calc OUT_DIR [STEPS=5]       the calculator experiment (episodes), k = 0, 1, no evaluation
set -euo pipefail
mode=${1:?default, judge or calc}; out=${2:?OUT_DIR}
case "$mode" in
  default) steps=${3:-30}; ks="0 1 2"; config=experiments/grpo_smollm2_arith.py; extra=() ;;
  judge) steps=${3:-15}; ks="0 1"; config=experiments/grpo_smollm2_arith.py
         extra=(--config.eval.size=0 --config.task.format_bonus=0.0
                --config.task.rewards='("docs/results/staleness-cpu/remote_judge.py:exact_match_after_latency",)') ;;
  calc) steps=${3:-5}; ks="0 1"; config=experiments/grpo_smollm2_calc.py
        extra=(--config.eval.size=0 --config.checkpoint_every="$steps") ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
mkdir -p "$out"
runs=()
for k in $ks; do
  /usr/bin/time -f '{"k": '$k', "user_s": %U, "sys_s": %S, "wall_s": %e, "max_rss_kb": %M}' -o "$out/time_k$k.json" \
    taskset -c 0,1 python -m branch_replay_jax.main --config="$config" --config.train.steps="$steps" \
      --config.train.max_staleness=$k "${extra[@]}" --config.run_dir="$out/k$k" > "$out/k$k.log" 2>&1
  runs+=("k$k=$out/k$k")
done
python -m branch_replay_jax.outputs.compare --runs="$(IFS=,; echo "${runs[*]}")" --out="$out/$mode.png"
cat "$out"/time_k*.json
