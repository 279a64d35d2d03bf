"""Where the replay step's and the naive step's time goes: a jax.profiler trace, summed by part.

  python -m branch_replay_jax.benchmarks.profile --config=experiments/bench_profile.py          # SmolLM2-135M
  python -m branch_replay_jax.benchmarks.profile --config=experiments/bench_profile.py:smoke    # tiny, seconds

Each (case, mode) is compiled, run once untimed, timed `repeats` times (wall and CPU seconds),
then run once more under `jax.profiler.trace`. XLA's CPU runtime records one trace event per
executed thunk (args hlo_module, hlo_op: the HLO instruction). Each instruction is attributed by
its metadata in the compiled HLO text: its stack frames name the repository function that made it
(`PART_RULES`), "transpose(" in its op_name marks the backward pass, and its opcode (or the ops of
its fused computation) gives its kind: matmul (dot, YNNPACK / oneDNN fusions), movement (copy,
transpose, slices, dynamic-update-slice, concatenate, pad, broadcast: layout changes and the scan
carry's stacking), control (while, conditional, call: containers, excluded from the sums) or
elementwise (the rest: softmax, norms, activations, reductions).

Prints one JSON object per (case, mode): P, T, G, mode, micro_batch, step_s (median wall),
cpu_s (median user+system), traced_s (the traced run's wall), op_s (sum of the op events'
self-times: thread time, so it can exceed traced_s when ops overlap on several threads),
by_part {part: {"fwd": s, "bwd": s}}, by_kind {kind: s}, by_part_kind {"part/kind": s}, top
(the `top` instructions by time with their part and kind) and xla_flags (the XLA_FLAGS it ran
under). The trace files stay in config.trace_dir (Perfetto JSON; open in ui.perfetto.dev), beside
the compiled HLO text (compiled.hlo.txt) whose instruction names the events carry.
"""

from __future__ import annotations

import functools

import collections
import glob
import gzip
import json
import linecache
import os
import re
import statistics
import time

import jax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax.benchmarks.replay import (GRPO_OBJECTIVE, case_inputs, cpu_seconds, emitter, load_model,
                                                 parse_case)
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad

MODES = ("replay", "naive")

# (file suffix, function name, part): the innermost stack frame matching a rule names the part of an
# HLO instruction. Projections are told apart by their einsum spec (PROJECTIONS) in the op_name.
PART_RULES = (
    ("kernels/reference.py", "_scores", "attention scores (QK)"),
    ("kernels/reference.py", "_mix", "attention mix (PV)"),
    ("kernels/reference.py", "suffix_attention", "attention mask+softmax"),
    ("models/llama.py", "token_logprobs", "log-prob head"),
    ("models/llama.py", "unembedding", "log-prob head"),
    ("models/llama.py", "rms_norm", "rmsnorm"),
    ("models/llama.py", "apply_rope", "rope"),
    ("models/llama.py", "rope_inv_freq", "rope"),
    ("models/llama.py", "project", "projections"),
    ("models/llama.py", "_matmul_2d", "projections"),   # project's dots, named by its spec (a named_scope)
    ("models/llama.py", "_layer", "layer other (silu, residual)"),
    ("models/llama.py", "__call__", "model"),   # split by its source line (CALL_LINES)
    ("models/llama.py", "prompt_and_rows", "model"),   # the fused replay's forward, likewise
    ("models/llama.py", "_scan_layers", "model"),      # the layer scan both run
    ("losses.py", "", "objective"),
    ("gradients/step.py", "", "segment glue (concat, where)"),
    ("gradients/heads.py", "", "segment glue (concat, where)"),
    ("core/accumulate.py", "", "scan carry / accumulation"),
    ("core/replay.py", "", "scan carry / accumulation"),
)
# A Llama.__call__ (prompt_and_rows, _scan_layers) instruction's part by a word of its source line (else "model glue").
CALL_LINES = (("embed", "embedding"), ("scan", "layer scan (weight slices, stacking)"),
              ("rms_norm", "rmsnorm"))
PROJECTIONS = {"btd,dhk->bthk": "qkv projections", "bthk,hkd->btd": "output projection",
               "btd,df->btf": "MLP gate+up", "btf,fd->btd": "MLP down"}
MOVEMENT = {"copy", "transpose", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "slice", "broadcast",
            "reshape", "bitcast", "reverse", "gather", "scatter", "iota", "copy-start", "copy-done"}
CONTROL = {"while", "conditional", "call", "tuple", "get-tuple-element"}
FREE = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element"}

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? ([a-z][a-z0-9-]*)\(")
_COMP = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_CALLS = re.compile(r"calls=%([\w.-]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def parse_hlo(text: str) -> dict:
  """{instruction name: {"opcode", "op_name", "frames": [(file, function, line), innermost first], "fused": inside
  a fused computation, "inner": opcodes of its fused computation}} from a compiled module's text (with its
  stack-frame tables). XLA drops the metadata of some rewritten dots (the attention einsums' batched
  dots, often): those have no op_name and no frames, and `part_of` calls them "no source"."""
  tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
  section, comps, current, instrs = None, collections.defaultdict(list), None, {}
  for line in text.splitlines():
    if line in tables:
      section = line
      continue
    if section and line and line[0].isdigit():
      key, rest = line.split(" ", 1)
      tables[section][int(key)] = rest
      continue
    section = None
    m = _COMP.match(line)
    if m:
      current = m.group(1)
      continue
    m = _INSTR.match(line)
    if m:
      name, opcode = m.groups()
      comps[current].append(opcode)
      op_name = _OPNAME.search(line)
      frame = _FRAME.search(line)
      calls = _CALLS.search(line)
      instrs[name] = {"opcode": opcode, "op_name": op_name.group(1) if op_name else "", "computation": current,
                      "frame": int(frame.group(1)) if frame else None, "calls": calls.group(1) if calls else None}
  field = lambda s, k: int(re.search(rf"{k}=(\d+)", s).group(1))
  unquote = lambda s: s.strip().strip('"')

  def frames(fid):
    out, seen = [], set()
    while fid and fid in tables["StackFrames"] and fid not in seen:
      seen.add(fid)
      s = tables["StackFrames"][fid]
      loc = tables["FileLocations"][field(s, "file_location_id")]
      out.append((unquote(tables["FileNames"][field(loc, "file_name_id")]),
                  unquote(tables["FunctionNames"][field(loc, "function_name_id")]), field(loc, "line")))
      fid = field(s, "parent_frame_id")
    return out

  fused = {ins["calls"] for ins in instrs.values() if ins["opcode"] == "fusion"}
  for ins in instrs.values():
    ins["frames"] = frames(ins.pop("frame"))
    ins["fused"] = ins.pop("computation") in fused   # inside a fusion: never a trace event of its own
    ins["inner"] = comps.get(ins.pop("calls"), [])
  return instrs


_SHAPED = re.compile(r"^\s*(?:ROOT )?%(\S+) = [a-z0-9]+\[([0-9,]*)\]\{([0-9,]*)[}:]")
_RELAYOUT = re.compile(r"^\s*(?:ROOT )?%(\S+) = [a-z0-9]+\[([0-9,]*)\]\{([0-9,]*)[}:].* (transpose|copy)\(%([\w.\-]+)\)"
                       r"(?:, dimensions=\{([0-9,]*)\})?")


def moving_transposes(text: str) -> list[tuple[str, tuple[int, ...]]]:
  """[(name, logical shape)] of the transpose and copy instructions (fused or not) of a compiled
  module's text that reorder data: whose result's physical element order differs from their
  operand's (size-1 axes ignored). XLA:CPU writes a layout change as a transpose whose result layout
  undoes it (a bitcast) followed by a copy into the default layout: the copy is listed. These are
  the layout copies of docs/design.md, "Step profile (CPU)"."""
  ints = lambda s: tuple(int(v) for v in (s or "").split(",") if v)
  shaped = {m.group(1): (ints(m.group(2)), ints(m.group(3))) for m in map(_SHAPED.match, text.splitlines()) if m}
  out = []
  for m in map(_RELAYOUT.match, text.splitlines()):
    if not m or m.group(5) not in shaped:
      continue
    dims, layout = ints(m.group(2)), ints(m.group(3))
    perm = ints(m.group(6)) if m.group(4) == "transpose" else tuple(range(len(dims)))
    in_dims, in_layout = shaped[m.group(5)]
    if len(in_layout) != len(in_dims) or len(layout) != len(dims):
      continue
    physical_out = [perm[a] for a in layout if dims[a] != 1]     # operand axes, minor to major
    physical_in = [a for a in in_layout if in_dims[a] != 1]
    if physical_out != physical_in:
      out.append((m.group(1), dims))
  return out


def part_of(ins: dict) -> str:
  """The repository part that made an instruction (PART_RULES; "other" when no frame matches)."""
  for file, function, line in ins["frames"]:
    names = function.replace("<locals>.", "").split(".")   # qualified: "Llama.__call__", "f.<locals>.g"
    for suffix, fn, part in PART_RULES:
      if file.endswith(suffix) and (not fn or fn in names):
        if part == "model":
          text = linecache.getline(file, line)
          return next((p for word, p in CALL_LINES if word in text), "model glue")
        if part == "projections":
          spec = next((s for s in PROJECTIONS if s in ins["op_name"]), None)
          return PROJECTIONS.get(spec, "projections (LoRA)")
        return part
  return "no source (XLA copies, loop plumbing)"


def kind_of(name: str, ins: dict) -> str:
  """matmul, movement, control or elementwise (see the module docstring)."""
  ops = set(ins["inner"]) - FREE if ins["opcode"] == "fusion" else {ins["opcode"]}
  if name.startswith(("ynn_", "onednn", "xnn")) or ops & {"dot", "convolution", "custom-call"}:
    return "matmul"
  if ins["opcode"] in CONTROL:
    return "control"
  if not ops or ops <= MOVEMENT:
    return "movement"
  return "elementwise"


def read_trace(trace_dir: str, module: str) -> dict[str, float]:
  """{hlo_op: self seconds} over the newest Perfetto trace in trace_dir, events of HLO module `module`.

  Self time: an event's duration less that of the events nested in it on the same thread (a while
  thunk encloses its body's thunks)."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)
  if not paths:
    raise RuntimeError(f"profile: no *.json.gz trace under {trace_dir!r}")
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  ops = [e for e in events if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_module") == module
         and "hlo_op" in e["args"]]
  by_thread = collections.defaultdict(list)
  for e in ops:
    by_thread[(e.get("pid"), e.get("tid"))].append(e)
  out = collections.Counter()
  for evs in by_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []   # [(end, name, child time)]
    for e in evs:
      while stack and stack[-1][0] <= e["ts"]:
        end, name, child, dur = stack.pop()
        out[name] += (dur - child) * 1e-6
      if stack:
        stack[-1][2] += e["dur"]
      stack.append([e["ts"] + e["dur"], e["args"]["hlo_op"], 0.0, e["dur"]])
    for end, name, child, dur in stack:
      out[name] += (dur - child) * 1e-6
  return dict(out)


def summarize(op_seconds: dict[str, float], instrs: dict, top: int) -> dict:
  """by_part, by_kind, by_part_kind and the top instructions of {hlo_op: seconds}."""
  by_part = collections.defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0})
  by_kind, by_part_kind = collections.Counter(), collections.Counter()
  rows = []
  for name, s in op_seconds.items():
    ins = instrs.get(name, {"opcode": "?", "op_name": "", "frames": [], "inner": []})
    kind = kind_of(name, ins)
    part = part_of(ins)
    by_kind[kind] += s
    if kind == "control":
      continue
    by_part[part]["bwd" if "transpose(" in ins["op_name"] else "fwd"] += s
    by_part_kind[f"{part}/{kind}"] += s
    rows.append((s, name, part, kind, ins["op_name"][-90:]))
  rows.sort(reverse=True)
  r = lambda x: round(x, 4)
  return {"op_s": r(sum(s for k, s in by_kind.items() if k != "control")),
          "by_part": {p: {k: r(v) for k, v in d.items()} for p, d in sorted(by_part.items(),
                                                                            key=lambda kv: -sum(kv[1].values()))},
          "by_kind": {k: r(v) for k, v in by_kind.most_common()},
          "by_part_kind": {k: r(v) for k, v in by_part_kind.most_common()},
          "top": [{"op": n, "s": r(s), "part": p, "kind": k, "op_name": o} for s, n, p, k, o in rows[:top]]}


def profile_step(config, case_index: int, mode: str) -> dict:
  """Compile, time and trace one mode of one case; returns its JSON record."""
  case = parse_case(config, case_index)
  model = load_model(config, remat=case["remat"])
  graphdef, params = nnx.split(model)
  naive_arrays, replay_arrays, counts = case_inputs(config, case, model.config)
  del model
  if mode == "naive":
    fn, arrays, m = functools.partial(value_and_grad, POLICY, layout="naive"), naive_arrays, config.naive_micro_batch
  else:
    fn, arrays, m = functools.partial(value_and_grad, POLICY), replay_arrays, config.replay_micro_batch
  step = jax.jit(lambda p, a: fn(graphdef, p, a, GRPO_OBJECTIVE, micro_batch=m, logprob_chunk=config.logprob_chunk))
  t0 = time.perf_counter()
  compiled = step.lower(params, arrays).compile()
  compile_s = time.perf_counter() - t0
  instrs = parse_hlo(compiled.as_text())
  module = compiled.as_text().split(",", 1)[0].split()[-1]   # "HloModule NAME, ..."
  jax.block_until_ready(compiled(params, arrays))   # warm-up, untimed
  times, cpus = [], []
  for _ in range(config.repeats):
    t0, c0 = time.perf_counter(), cpu_seconds()
    jax.block_until_ready(compiled(params, arrays))
    times.append(time.perf_counter() - t0)
    cpus.append(cpu_seconds() - c0)
  trace_dir = os.path.join(config.trace_dir, f"case{case_index}_{mode}")
  os.makedirs(trace_dir, exist_ok=True)
  with open(os.path.join(trace_dir, "compiled.hlo.txt"), "w") as f:   # the instructions the trace names
    f.write(compiled.as_text())
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(params, arrays))
    traced_s = time.perf_counter() - t0
  summary = summarize(read_trace(trace_dir, module), instrs, config.top)
  return {"P": case["P"], "T": case["T"], "G": case["G"], "mode": mode, "micro_batch": m,
          "step_s": round(statistics.median(times), 4), "cpu_s": round(statistics.median(cpus), 4),
          "times": [round(x, 4) for x in times], "traced_s": round(traced_s, 4), "compile_s": round(compile_s, 2),
          **summary, "ideal_flop_ratio": counts.get("ideal_flop_ratio"), "model": config.model,
          "dtype": config.dtype, "xla_flags": os.environ.get("XLA_FLAGS", ""), "load_avg": os.getloadavg()[0],
          "trace_dir": trace_dir}


def check_config(config) -> None:
  """ValueError naming the field for a bad profile config, before any compute."""
  for mode in config.modes:
    if mode not in MODES:
      raise ValueError(f"bench_profile: modes entry {mode!r} is not one of {MODES}")
  for field in ("repeats", "naive_micro_batch", "replay_micro_batch", "top", "logprob_chunk"):
    if not isinstance(config[field], int) or config[field] < (0 if field == "top" else 1):
      raise ValueError(f"bench_profile: {field}={config[field]!r} must be a positive int")
  if config.tree_cases or config.ppo_cases:
    raise ValueError("bench_profile: tree_cases and ppo_cases must be empty (the profile covers prompt groups)")


def main(argv):
  del argv
  config = flags.FLAGS.config
  check_config(config)
  emit = emitter(config.output)
  for i in range(len(config.cases)):
    for mode in config.modes:
      emit(profile_step(config, i, mode))


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_profile.py", "Profile config.")
  app.run(main)
