"""The benchmark's smoke variant runs end to end and prints machine-readable, self-consistent rows."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"case", "P", "T", "G", "naive_s", "replay_s", "speedup", "ideal_flop_ratio", "token_positions_naive",
            "token_positions_computed", "max_rel_grad_err", "naive_peak_bytes", "replay_peak_bytes",
            "padding_fraction", "naive_compile_s", "replay_compile_s"}


@pytest.mark.slow
def test_bench_smoke_prints_one_json_row_per_case():
  proc = subprocess.run([sys.executable, "-m", "branch_replay_jax.bench", "--config=experiments/bench_replay.py:smoke"],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  rows = [r for r in rows if "error" not in r]
  assert [r["kind"] for r in rows] == ["group", "tree"]
  for r in rows:
    assert REQUIRED <= set(r)
    # float32 replay vs naive on the tiny model: rounding only.
    assert r["max_rel_grad_err"] <= 1e-5
    assert r["speedup"] == pytest.approx(r["naive_s"] / r["replay_s"])
    assert len(r["naive_times"]) == len(r["replay_times"]) == 2
  # Group (24, 6, 4): naive 4 x 30 = 120 positions, replay 24 + 24 = 48.
  assert (rows[0]["token_positions_naive"], rows[0]["token_positions_computed"]) == (120, 48)
  # Tree (16, 4, [2, 2]): 4 paths of 16 + 8 = 96 naive positions; 16 + 2*4 + 4*4 = 40 computed.
  assert (rows[1]["token_positions_naive"], rows[1]["token_positions_computed"]) == (96, 40)
