#!/bin/bash
# PPO replay step at (512, 64, 8), before (c60fde0 at /tmp/base) and after (main), alternating, pinned to core 1.
for round in 1 2; do
for side in base main; do
  dir=/tmp/base; [ $side = main ] && dir=/work/main
  cd $dir && taskset -c 1 /work/main/.venv/bin/python -m branch_replay_jax.benchmarks.replay --config=experiments/bench_replay.py \
    --config.cases="()" --config.tree_cases="()" --config.naive_micro_batches=G --config.replay_micro_batches=G --config.repeats=3 2>/dev/null \
    | grep '^{' | sed "s/^{/{\"side\": \"$side\", \"round\": $round, /"
done; done
# Per-device bytes of the loop's own mesh step (grpo.GRPOFunctions.train_step), Llama-3.2-1B, P = 8192, FSDP, 1 x 8 x 1.
cd /work/main && taskset -c 1 /work/main/.venv/bin/python -m branch_replay_jax.benchmarks.sharded_memory --config=experiments/bench_sharded_memory.py \
  --config.models=llama-3.2-1b --config.layouts=fsdp --config.prompt_lengths="(8192,)" --config.search_remats="" --config.naive=False 2>/dev/null | grep '^{' > /tmp/sharded_1b.jsonl
