"""The benchmark's smoke variant runs end to end and prints machine-readable, self-consistent rows."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"case", "P", "T", "G", "naive_s", "replay_s", "speedup", "ideal_flop_ratio", "token_positions_naive",
            "token_positions_computed", "max_rel_grad_err", "naive_peak_bytes", "replay_peak_bytes",
            "padding_fraction", "naive_compile_s", "replay_compile_s"}


# Each mode and micro-batch candidate is a fresh process that compiles: the group case ~1 min, all three
# kinds ~3 min on 2 cores: both heavy. In CI the benchmarks' shared pieces (load_model, the JSON emitter,
# the step builder's replay and naive layouts, the objectives) run through
# test_bench_episodes_smoke_prints_the_three_layouts_and_the_sampler.
@pytest.mark.slow
@pytest.mark.parametrize("kinds", [pytest.param(("group",), id="group", marks=pytest.mark.heavy),
                                   pytest.param(("group", "tree", "ppo"), id="all", marks=pytest.mark.heavy)])
def test_bench_smoke_prints_one_json_row_per_case(kinds):
  only_group = ["--config.tree_cases=()", "--config.ppo_cases=()"] if kinds == ("group",) else []
  proc = subprocess.run([sys.executable, "-m", "branch_replay_jax.benchmarks.replay", "--config=experiments/bench_replay.py:smoke",
                         *only_group], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  rows = [r for r in rows if "error" not in r]
  assert tuple(r["kind"] for r in rows) == kinds
  for r in rows:
    assert REQUIRED <= set(r)
    # float32 replay vs naive on the tiny model: rounding only.
    assert r["max_rel_grad_err"] <= 1e-5
    assert r["speedup"] == pytest.approx(r["naive_s"] / r["replay_s"])
    assert len(r["naive_times"]) == len(r["replay_times"]) == 2
  # Group (24, 6, 4): naive 4 x 30 = 120 positions, replay 24 + 24 = 48.
  assert (rows[0]["token_positions_naive"], rows[0]["token_positions_computed"]) == (120, 48)
  if len(rows) == 3:
    # Tree (16, 4, [2, 2]): 4 paths of 16 + 8 = 96 naive positions; 16 + 2*4 + 4*4 = 40 computed.
    assert (rows[1]["token_positions_naive"], rows[1]["token_positions_computed"]) == (96, 40)
    # PPO (24, 6, 4): the group's positions, for policy log-probs and values alike.
    assert (rows[2]["token_positions_naive"], rows[2]["token_positions_computed"]) == (120, 48)


def _bench_memory(*overrides):
  proc = subprocess.run([sys.executable, "-m", "branch_replay_jax.benchmarks.memory",
                         "--config=experiments/bench_memory.py:smoke", *overrides],
                        cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.heavy   # minutes on 2 cores; `make test-all` runs it, CI does not
def test_bench_memory_smoke_rows():
  rows = _bench_memory()
  attempts = [r for r in rows if not r.get("summary")]
  assert all(r["bound"] is None for r in attempts), [r.get("error") for r in attempts]
  # memory_vs_g: replay and naive (micro-batch 1) at G = 2 and 8; longest_context: P = 64, 128 for
  # replay (offload_kv) and naive (none), then max_p = 128 ends each search.
  assert [(r["study"], r["mode"], r["G"], r["P"]) for r in attempts] == [
      ("memory_vs_g", "replay", 2, 64), ("memory_vs_g", "naive", 2, 64),
      ("memory_vs_g", "replay", 8, 64), ("memory_vs_g", "naive", 8, 64),
      ("longest_context", "replay", 4, 64), ("longest_context", "replay", 4, 128),
      ("longest_context", "naive", 4, 64), ("longest_context", "naive", 4, 128)]
  for r in attempts:
    assert r["temp_bytes"] > 0 and r["peak_bytes"] > r["temp_bytes"]   # RSS adds parameters and runtime
    assert r["token_positions_naive"] == r["G"] * (r["P"] + r["T"])
  summaries = {(r["study"], r["mode"]): r for r in rows if r.get("summary")}
  # Micro-batch 1: one branch's activations live at a time; G enters only through the [G, T]
  # inputs (tens of bytes here), so the compiled temp bytes of G=8 and G=2 agree within 5%.
  assert summaries["memory_vs_g", "replay"]["temp_ratio_G8_over_G2"] == pytest.approx(1.0, abs=0.05)
  for mode in ("replay", "naive"):
    s = summaries["longest_context", mode]
    assert (s["largest_P"], s["failed_P"], s["stopped_by"], s["attempts"]) == (128, None, "max_p", 2)
    assert s["token_positions_naive"] == 4 * (128 + 8)


def test_bench_memory_search_names_the_bound_that_stopped_it():
  # A 1 s cap stops an attempt before JAX has even compiled; a 300 MB resident-set cap stops it
  # while compiling (the tiny model's worker peaks near 600 MB). Either way P = 64 fails first.
  base = ("--config.studies=longest_context", "--config.policies=save_kv", "--config.naive_policies=")
  for override, bound in (("--config.attempt_timeout_s=1", "time"), ("--config.rss_limit_bytes=300000000", "memory")):
    (attempt, summary) = _bench_memory(*base, override)
    assert (attempt["P"], attempt["bound"]) == (64, bound)
    assert (summary["largest_P"], summary["failed_P"], summary["stopped_by"]) == (None, 64, bound)


def test_largest_passing_doubles_then_bisects_to_the_granularity():
  from branch_replay_jax.benchmarks.memory import largest_passing
  tried = []

  def attempt(p):   # passes up to 1500 tokens, then "memory"
    tried.append(p)
    return None if p <= 1500 else "memory"
  # 1024 passes, 2048 fails; bisection: 1536 fails, 1280 passes; 1536 - 1280 = 256 ends it.
  assert largest_passing(attempt, 1024, 256, 1 << 20) == (1280, 1536, "memory")
  assert tried == [1024, 2048, 1536, 1280]
  assert largest_passing(lambda p: None, 1024, 256, 3000) == (3000, None, "max_p")   # 1024, 2048, 3000
  assert largest_passing(lambda p: "time", 1024, 256, 4096) == (None, 1024, "time")
  with pytest.raises(ValueError, match="max_p=512"):
    largest_passing(attempt, 1024, 256, 512)


def test_default_cases_parse_with_their_remat_policies():
  # experiments/bench_replay.py: three groups, two trees, one PPO case; a 4th tuple entry names the
  # case's remat policy (both modes), otherwise config.remat ("none") applies.
  from branch_replay_jax.benchmarks import replay as bench
  from experiments import bench_replay
  config = bench_replay.get_config()
  cases = [bench.parse_case(config, i) for i in range(len(config.cases) + len(config.tree_cases) + len(config.ppo_cases))]
  assert [(c["kind"], c["P"], c["T"], c["G"], c["remat"]) for c in cases] == [
      ("group", 1024, 128, 8, "none"), ("group", 2048, 128, 8, "save_kv"), ("group", 512, 64, 16, "none"),
      ("tree", 1024, 64, 16, "save_kv"), ("tree", 256, 32, 16, "none"), ("ppo", 512, 64, 8, "none")]
  assert cases[3]["fanouts"] == [4, 2, 2] and cases[4]["fanouts"] == [2, 2, 2, 2]


def test_compile_only_attempt_estimates_memory_and_meets_the_budget():
  # A compile-only longest-context attempt runs nothing: its estimated peak is the resident set
  # after compile plus XLA's temp and output buffers, and it fails with bound "memory" exactly when
  # that estimate exceeds config.memory_budget_bytes.
  from branch_replay_jax.benchmarks import memory as bench_memory
  from experiments import bench_memory as bench_memory_config
  config = bench_memory_config.get_config("smoke")
  job = {"config": config.to_dict(), "mode": "replay", "remat": "save_kv", "P": 64, "T": 8, "G": 4, "micro_batch": 1,
         "compile_only": True}
  r = bench_memory._worker(job)
  assert "step_s" not in r and r["memory_measure"] == "compiled_estimate"
  assert r["temp_bytes"] > 0
  assert r["estimated_peak_bytes"] == r["rss_after_compile_bytes"] + r["temp_bytes"] + r["output_bytes"]
  assert bench_memory._bound(r, memory_budget_bytes=r["estimated_peak_bytes"]) is None
  assert bench_memory._bound(r, memory_budget_bytes=r["estimated_peak_bytes"] - 1) == "memory"
  assert bench_memory._bound({"error": "timeout"}) == "time"


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_sharded_memory_fsdp_state_is_an_eighth_plus_one_layer():
  # Compile only, tiny model, 1 x 8 x 1 mesh. FSDP: each device's parameters + AdamW state (mu, nu)
  # + gradient are within 1.25x of their total / 8 + one layer's gathered weights (FSDP's target);
  # replicated they are the 4 full copies. The compiler's argument bytes (parameters, optimizer
  # state, batch shard) agree: FSDP's are under a quarter of replicated's.
  import ml_collections
  from branch_replay_jax.benchmarks import sharded_memory
  c = ml_collections.ConfigDict(dict(mesh=(1, 8, 1), dtype="float32", G=8, T=16, micro_batch=1, logprob_chunk=16,
                                     attention_impl="xla", expert_matmul="ragged_dot", expert="", lora_rank=0,
                                     base_dtype="bfloat16"))
  rep = sharded_memory.replay_case(c, "tiny", "replicated", "save_kv", 64)
  fsdp = sharded_memory.replay_case(c, "tiny", "fsdp", "save_kv", 64)
  assert fsdp["state_ratio"] <= 1.25 < rep["state_ratio"]
  # params + mu + nu, all local (+ AdamW's int32 step count); tiny: every leaf splits 8 ways
  assert 0 <= rep["state_bytes"] - 3 * rep["parameter_bytes_total"] <= 16
  assert abs(8 * fsdp["state_bytes"] - rep["state_bytes"]) <= 8 * 16
  assert fsdp["argument_bytes"] < rep["argument_bytes"] / 4
  # LoRA (rank 2, every target) on a bfloat16 base: the adapters with their mu and nu, and the base once, each an
  # eighth per device under FSDP (the loop's `frozen`, placed like the parameters)
  c.lora_rank = 2
  low = sharded_memory.replay_case(c, "tiny", "fsdp", "save_kv", 64)
  _, adapters, base = sharded_memory._abstract_model(sharded_memory._architecture("tiny"), "float32", "save_kv",
                                                     "xla", 2, "bfloat16")
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(base))
  assert 0 <= 8 * low["state_bytes"] - (3 * nbytes(adapters) + nbytes(base)) <= 8 * 16
  assert low["lora_rank"] == 2 and low["grad_bytes"] * 8 == nbytes(adapters)


def test_lora_memory_accounts_adapters_base_and_reference():
  # Compile only, tiny model, one device. Full fine-tuning holds the parameters, their reference
  # copy and AdamW's mu, nu (+ an int32 step count); LoRA holds the base (frozen: no optimizer
  # state, no copy), the adapters, their zero reference and their mu, nu. Adapter bytes: float32
  # r (fan-in + fan-out) per projection and layer; a bfloat16 base is half the float32 one.
  import ml_collections
  import numpy as np
  from branch_replay_jax.benchmarks import lora_memory
  from branch_replay_jax.models import lora
  from branch_replay_jax.models.config import tiny_config
  c = ml_collections.ConfigDict(dict(rank=4, alpha=8.0, targets=lora.TARGETS, dtype="float32", remat="save_kv",
                                     G=2, P=16, T=4, micro_batch=1, logprob_chunk=4))
  full, low = lora_memory.case(c, "tiny", "full"), lora_memory.case(c, "tiny", "lora", "bfloat16")
  cfg = tiny_config()
  adapters = 4 * cfg.num_layers * sum(4 * (np.prod(i) + np.prod(o)) for i, o in lora.projection_shapes(cfg).values())
  assert full["reference_bytes"] == full["trained_bytes"] and full["frozen_bytes"] == 0
  assert 0 <= full["opt_state_bytes"] - 2 * full["trained_bytes"] <= 16
  assert low["trained_bytes"] == low["reference_bytes"] == low["grad_bytes"] == adapters
  assert low["frozen_bytes"] == full["trained_bytes"] // 2
  assert 0 <= low["opt_state_bytes"] - 2 * adapters <= 16
  assert low["state_bytes"] == low["frozen_bytes"] + 4 * adapters + (low["opt_state_bytes"] - 2 * adapters)
  assert low["argument_bytes"] < full["argument_bytes"] / 2   # the compiled step's inputs: the state above + batch


@pytest.mark.slow   # ~2 min on 2 loaded cores: three step compiles and the sampler's
def test_bench_episodes_smoke_prints_the_three_layouts_and_the_sampler():
  proc = subprocess.run([sys.executable, "-m", "branch_replay_jax.benchmarks.episodes",
                         "--config=experiments/bench_episodes.py:smoke"], cwd=ROOT, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert len(rows) == 1
  r = rows[0]
  assert {"ideal_flop_ratio", "ideal_flop_ratio_prompt_only", "naive_s", "replay_s", "prompt_only_s", "naive_cpu_s",
          "replay_cpu_s", "prompt_only_cpu_s", "speedup", "prompt_only_speedup", "speedup_over_ideal",
          "sampler_kept_s_per_episode", "sampler_reprefill_s_per_episode", "sampler_speedup"} <= set(r)
  # (P, T, O, fanouts) = (16, 4, 6, [2, 2]): 4 episodes of turn(4) observation(6) turn(4) = 14 tokens.
  # Naive: 4 x (16 + 14) = 120 positions; replay: 16 + 2 x (4 + 6) + 4 x 4 = 52; prompt-only: 16 + 4 x 14 = 72.
  assert (r["G"], r["token_positions_naive"], r["token_positions_replay"], r["token_positions_prompt_only"]) == (
      4, 120, 52, 72)
  assert r["ideal_flop_ratio"] > r["ideal_flop_ratio_prompt_only"] > 1
  # float32, the same terms in every layout: rounding only.
  assert r["max_rel_grad_err"] <= 1e-5 and r["max_rel_grad_err_prompt_only"] <= 1e-5
  assert r["speedup"] == pytest.approx(r["naive_s"] / r["replay_s"])
  assert r["prompt_only_speedup"] == pytest.approx(r["naive_s"] / r["prompt_only_s"])
  # Sampler, per episode: kept prefills the prompt once for the 4 branches (16 / 4) and per later turn the
  # last sampled id + the observation (7); re-prefilling runs the prompt, then prompt + turn + observation (26).
  assert (r["sampler_kept_prefilled_per_episode"], r["sampler_reprefill_prefilled_per_episode"]) == (11, 42)


def test_replay_memory_modes_and_the_largest_p_it_extrapolates():
  from branch_replay_jax.benchmarks import replay_memory
  assert replay_memory.parse_mode("naive:2", 8) == {"layout": "naive", "micro_batch": 2}
  assert replay_memory.parse_mode("replay:8", 8) == {"layout": "replay", "micro_batch": 8, "fused": False}
  assert replay_memory.parse_mode("fused", 8) == {"fused": True}
  for bad in ("replay:3", "naive", "fused:8", "tree:1"):   # 3 does not divide G = 8; the others are no mode
    with pytest.raises(ValueError, match="is not 'naive:M'"):
      replay_memory.parse_mode(bad, 8)
  # 1 GiB per 1024 prompt tokens from zero: a 96 GiB budget holds 96 * 1024 tokens, 141 GiB 141 * 1024.
  row = {"model": "m", "mode": "fused", "G": 8, "T": 128, "remat": "save_kv"}
  rows = [{**row, "P": 2048, "total_bytes": 2 * 2 ** 30}, {**row, "P": 1024, "total_bytes": 2 ** 30}]
  out = replay_memory.summary(rows, (96, 141))
  assert out["bytes_per_token"] == 2 ** 20 and out["fit_P"] == [1024, 2048]
  assert out["largest_P_by_budget_gib"] == {"96": 96 * 1024, "141": 141 * 1024}


def test_gpu_bench_entry_points_give_finite_fields_and_a_markdown_table(tmp_path):
  # scripts/gpu_bench.sh's new Python, in smoke shapes on the CPU: the prompt-attention row (cuDNN
  # skipped with its reason off a GPU), the replay row's MFU fields, and summarize's tables of both.
  import math

  import jax.numpy as jnp
  import ml_collections
  from branch_replay_jax.benchmarks import prompt_attention, replay, summarize
  from branch_replay_jax.data.counts import group_counts
  from branch_replay_jax.models.config import tiny_config
  row = prompt_attention.bench_prompt(32, b=1, hq=2, hkv=1, d=16, dtype=jnp.float32, repeats=1,
                                      impls=("reference", "dpa_xla", "dpa_cudnn"))
  for name in ("reference", "dpa_xla"):
    e = row[name]
    assert all(math.isfinite(e[k]) and e[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops"))
    # float32, the same softmax in another order of sums: rounding only
    assert e["max_abs_diff"] <= 1e-5
  if jax.default_backend() != "gpu":
    assert row["dpa_cudnn"] == {"skipped": "cuDNN needs a GPU; the backend is cpu"}
  # causal pairs of a 32-token block: 32 * 33 / 2 = 528, 4 D = 64 FLOPs each per head, 2 heads
  assert row["fwd_gflop"] == round(2 * 64 * 528 / 1e9, 3)
  # MFU: 3x the forward FLOPs of data.counts (the ideal ratio's model) per second, over the peak.
  counts = group_counts(24, [6] * 4, tiny_config(vocab_size=256, max_positions=4096))
  config = ml_collections.ConfigDict(dict(fused="auto", prompt_attention="model", peak_tflops=100.0))
  record = {"P": 24, "T": 6, "G": 4, "naive_s": 2e-3, "replay_s": 1e-3, "speedup": 2.0, **counts}
  mfu = replay.mfu_fields(config, record)
  assert counts["naive_forward_flops"] / counts["replay_forward_flops"] == pytest.approx(counts["ideal_flop_ratio"])
  assert mfu["replay_tflops"] == pytest.approx(3 * counts["replay_forward_flops"] / 1e-3 / 1e12)
  assert mfu["replay_mfu"] == pytest.approx(mfu["replay_tflops"] / 100.0)
  assert mfu["naive_mfu"] == pytest.approx(3 * counts["naive_forward_flops"] / 2e-3 / 1e12 / 100.0)
  with open(tmp_path / "prompt_attention.jsonl", "w") as f:
    f.write(json.dumps(row) + "\n")
  with open(tmp_path / "replay.jsonl", "w") as f:
    f.write(json.dumps({**record, **mfu, "speedup_over_ideal": 2.0 / counts["ideal_flop_ratio"]}) + "\n")
  text = summarize.summarize(str(tmp_path))
  assert "### Replay against naive, with MFU" in text and "| 24 | 6 | 4 |" in text
  assert "| 32 | 2:1, 16 | dpa_xla |" in text
  assert "dpa_cudnn: skipped" in text or jax.default_backend() == "gpu"


def test_causal_block_attention_sends_the_prompt_to_dot_product_attention_and_the_rest_to_the_kernel():
  # float32: the prompt's own causal block through jax.nn.dot_product_attention("xla") equals the
  # jnp suffix attention on it (the same softmax, another order of sums: <= 1e-5); a block with
  # ancestors goes to the given function unchanged (here the reference itself: equal bit for bit).
  import numpy as np
  import jax.numpy as jnp
  from branch_replay_jax.kernels import causal_block_attention
  from branch_replay_jax.kernels import KVBlock, suffix_attention
  rng = np.random.default_rng(0)
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, k, v = n(1, 12, 4, 8), n(1, 12, 2, 8), n(1, 12, 2, 8)
  own = KVBlock(k, v, jnp.arange(12)[None] < 10)   # two padded keys at the end (right padding)
  attention = causal_block_attention("xla", suffix_attention)
  out, lse = attention(q, [], own)
  want, want_lse = suffix_attention(q, [], own)
  assert float(jnp.max(jnp.abs(out[:, :10] - want[:, :10]))) <= 1e-5 * float(jnp.max(jnp.abs(want)))
  assert float(jnp.max(jnp.abs(lse[:, :10] - want_lse[:, :10]))) <= 1e-5 * float(jnp.max(jnp.abs(want_lse)))
  anc = [KVBlock(n(1, 5, 2, 8), n(1, 5, 2, 8), jnp.ones((1, 5), bool))]
  assert all(bool(jnp.array_equal(a, b)) for a, b in zip(attention(q, anc, own), suffix_attention(q, anc, own)))
  with pytest.raises(ValueError, match="implementation='tpu'"):
    causal_block_attention("tpu", suffix_attention)


def test_ring_cache_smoke_times_both_caches_on_the_same_samples():
  # experiments/bench_ring_cache.py:smoke: a small random Gemma 3 (W = 4) decoding 2 x 12 tokens with the whole
  # cache and with the ring: one row each, every sample decoding all 12 tokens (no EOS), finite positive times.
  from branch_replay_jax.benchmarks import ring_cache
  from experiments import bench_ring_cache
  args = bench_ring_cache.get_config("smoke")
  rows = [ring_cache.time_row(args, ring) for ring in (False, True)]
  assert [r["ring"] for r in rows] == [False, True] and [r["generated"] for r in rows] == [24, 24]
  assert all(r["window"] == 4 and 0 < r["wall_seconds"] and 0 < r["cpu_seconds"] for r in rows)
