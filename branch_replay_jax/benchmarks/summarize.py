"""Markdown tables from the JSON lines of scripts/gpu_bench.sh, ready for docs/results/<study>/README.md.

    python -m branch_replay_jax.benchmarks.summarize gpu_out                 # prints the tables
    python -m branch_replay_jax.benchmarks.summarize gpu_out --output gpu_out/summary.md

Reads, where present, in DIR: replay.jsonl (benchmarks/replay.py rows: replay vs naive, with MFU),
mesh.jsonl (benchmarks/mesh.py), prompt_attention.jsonl (benchmarks/prompt_attention.py),
attention.jsonl (benchmarks/attention.py) and stages.jsonl (gpu_bench.sh: one line per stage with
its exit status and seconds). Every row that carries an "error" (or an implementation's "error" /
"skipped") is listed under "Errors and skips" instead of a table. Seconds are printed as measured
(3 significant figures), ratios to 2 decimals; nothing is computed here that the rows do not hold
except peak GB (bytes / 1e9).
"""

from __future__ import annotations

import argparse
import json
import os

FILES = ("replay", "mesh", "prompt_attention", "attention", "stages")


def read_jsonl(path: str) -> list[dict]:
  """The JSON objects of a file, one a line (blank lines and lines not starting with '{' skipped);
  [] when the file does not exist."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.lstrip().startswith("{")]


def fmt(x, digits: int = 3) -> str:
  """A cell: '-' for None, ints as they are, floats to `digits` significant figures."""
  if x is None:
    return "-"
  if isinstance(x, bool) or isinstance(x, int) or isinstance(x, str):
    return str(x)
  return f"{x:.{digits}g}"


def table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
  lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _gb(x) -> str:
  return "-" if x is None else f"{x / 1e9:.1f}"


def replay_table(rows: list[dict]) -> str:
  header = ["P", "T", "G", "remat", "attention", "fused", "prompt attention", "naive_s", "replay_s", "speedup",
            "ideal_flop_ratio", "speedup / ideal", "replay TFLOP/s", "replay MFU", "naive MFU",
            "micro-batch naive / replay", "peak GB naive / replay", "max_rel_grad_err"]
  out = []
  order = lambda r: (r["P"], r["T"], r["G"], str(r.get("attention_impl")), r.get("fused") != "auto",
                     r.get("prompt_attention") != "model", str(r.get("fused")), str(r.get("prompt_attention")))
  for r in sorted(rows, key=order):   # each case's default replay (fused auto, the model's attention) first
    out.append([r["P"], r["T"], r["G"], r.get("remat"), r.get("attention_impl"), r.get("fused"),
                r.get("prompt_attention"), r.get("naive_s"), r.get("replay_s"), fmt(r.get("speedup"), 3),
                fmt(r.get("ideal_flop_ratio"), 3), fmt(r.get("speedup_over_ideal"), 2), r.get("replay_tflops"),
                fmt(r.get("replay_mfu"), 2), fmt(r.get("naive_mfu"), 2),
                f"{fmt(r.get('naive_micro_batch'))} / {fmt(r.get('replay_micro_batch'))}",
                f"{_gb(r.get('naive_peak_bytes'))} / {_gb(r.get('replay_peak_bytes'))}",
                fmt(r.get("max_rel_grad_err"), 2)])
  peaks = sorted({r.get("peak_tflops") for r in rows if r.get("peak_tflops")})
  note = f"\n\nMFU against a peak of {', '.join(fmt(p) for p in peaks)} TFLOP/s (config.peak_tflops)." if peaks else ""
  return table(header, out) + note


def mesh_table(rows: list[dict]) -> str:
  header = ["algorithm", "mesh", "attention", "dtype", "groups x G", "P", "T", "micro_batch", "step_s", "compile_s",
            "baseline", "loss_rel_diff", "max_rel_grad_err"]
  out = [[r["algorithm"], r["mesh"] + (" (fused)" if r.get("one_device_fused") else ""), r.get("attention_impl"),
          r.get("dtype"), f"{r['groups']} x {r['group_size']}", r["prompt_len"], r["completion_len"], r["micro_batch"],
          r["step_seconds"], r["compile_seconds"], r.get("baseline"), fmt(r.get("loss_rel_diff"), 2),
          fmt(r["max_rel_grad_err"], 2)] for r in rows]
  return table(header, out)


def _impls(row: dict) -> list[tuple[str, dict]]:
  return [(k, v) for k, v in row.items() if isinstance(v, dict)]


def prompt_attention_table(rows: list[dict]) -> str:
  header = ["P", "Hq:Hkv, D", "implementation", "fwd_ms", "fwd_bwd_ms", "fwd TFLOP/s", "fwd_bwd TFLOP/s", "compile_s",
            "max_abs_diff"]
  out = []
  for r in rows:
    for name, e in _impls(r):
      if "fwd_ms" in e:
        out.append([r["P"], f"{r['hq']}:{r['hkv']}, {r['d']}", name, e["fwd_ms"], e["fwd_bwd_ms"], e["fwd_tflops"],
                    e["fwd_bwd_tflops"], e["compile_s"], fmt(e.get("max_abs_diff"), 2)])
  text = table(header, out)
  for r in rows:
    if "pallas_over_cudnn_fwd_bwd" in r:
      text += (f"\n\nP = {r['P']}: ours / cuDNN = {r['pallas_over_cudnn_fwd']:.2f} (forward), "
               f"{r['pallas_over_cudnn_fwd_bwd']:.2f} (forward+backward).")
  return text


def attention_table(rows: list[dict]) -> str:
  header = ["S_anc, T", "implementation", "fwd_ms", "fwd_bwd_ms", "fwd_bwd TFLOP/s", "compile_s"]
  out = [[f"{r['s_anc']}, {r['t']}", name, e["fwd_ms"], e["fwd_bwd_ms"], e.get("fwd_bwd_tflops"), e["compile_s"]]
         for r in rows for name, e in _impls(r) if "fwd_ms" in e]
  return table(header, out)


def stages_table(rows: list[dict]) -> str:
  return table(["stage", "exit status", "seconds", "time box s"],
               [[r["stage"], r["rc"], r["seconds"], r.get("timeout_s")] for r in rows])


def problems(data: dict[str, list[dict]]) -> list[str]:
  """One line per failed row, failed or skipped implementation and failed stage."""
  out = []
  for name, rows in data.items():
    for r in rows:
      where = {k: r[k] for k in ("P", "T", "G", "mode", "mesh", "s_anc", "t", "stage", "fused", "prompt_attention",
                                 "naive_micro_batch", "replay_micro_batch") if r.get(k) is not None}
      if "error" in r:
        out.append(f"- {name} {json.dumps(where)}: error {r['error']}")
      if name == "stages" and r.get("rc"):
        out.append(f"- stage {r['stage']}: exit status {r['rc']}" + (" (time box)" if r.get("timed_out") else ""))
      for impl, e in _impls(r):
        for key in ("error", "skipped"):
          if key in e:
            out.append(f"- {name} {json.dumps(where)} {impl}: {key} {e[key]}")
  return out


def summarize(directory: str) -> str:
  """The markdown of every JSONL file of `directory` (module docstring)."""
  data = {name: read_jsonl(os.path.join(directory, f"{name}.jsonl")) for name in FILES}
  ok = lambda rows: [r for r in rows if "error" not in r]
  replay = [r for r in ok(data["replay"]) if r.get("replay_s") is not None and "speedup" in r]
  sections = [("Replay against naive, with MFU", replay, replay_table),
              ("The mesh code path on one device", ok(data["mesh"]), mesh_table),
              ("A prompt's own causal attention: ours against cuDNN", ok(data["prompt_attention"]),
               prompt_attention_table),
              ("Suffix attention", ok(data["attention"]), attention_table),
              ("Stages", data["stages"], stages_table)]
  parts = [f"### {title}\n\n{fn(rows)}" for title, rows, fn in sections if rows]
  issues = problems(data)
  if issues:
    parts.append("### Errors and skips\n\n" + "\n".join(issues))
  return "\n\n".join(parts) + "\n" if parts else "(no JSON lines found)\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("directory", help="the folder of JSONL files (gpu_bench.sh's $OUT)")
  parser.add_argument("--output", default="", help="also write the markdown to this file")
  args = parser.parse_args(argv)
  text = summarize(args.directory)
  print(text, end="")
  if args.output:
    with open(args.output, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
