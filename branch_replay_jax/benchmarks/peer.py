"""Our replay and naive steps side by side with PyTorch's naive step and PrefixGrouper's shared-prefix step.

  python -m branch_replay_jax.benchmarks.peer --config=experiments/bench_peer.py

Optional peer, never run in CI: needs the `peer` extra (`pip install -e .[peer]`: torch and
prefix-grouper; transformers is already a dependency). All four steps compute one on-policy GRPO
loss and its parameter gradient on the same group (the same random tokens and advantages,
`replay.case_inputs`) with the same model: ours from the GGUF as models.load reads it, PyTorch's
from the same GGUF file through transformers (`gguf_file=`, de-quantised to float32).

- replay, naive: `replay._worker` (bench_replay.py's steps: jitted, log-probs at completion
  positions only, naive at config.naive_micro_batch).
- torch_naive: the prompt repeated per completion, [m, P + T] sequences per forward+backward
  (SDPA attention, gradients summed over the G / m micro-batches), m the fastest of
  config.torch_micro_batches (each candidate timed once in round 0; later rounds use the winner).
- prefix_grouper: one packed sequence [1, P + G * T], the prompt once and every completion after it
  at positions P..P+T-1, attention through the `prefix_grouper` package (`PrefixGrouper.forward`:
  the prompt's causal attention once, each completion over [prompt ; itself]; SDPA inside, with the
  causal mask aligned bottom-right), logits of the completion positions only.

Each (round, mode) runs in a fresh process, the modes taking turns in every round, so other jobs'
load falls on all alike. Prints one JSON line per run and, per case, a summary with the median
wall and CPU seconds of each mode and the ratios replay / prefix_grouper, naive / torch_naive,
replay / torch_naive, with the load average.
"""

from __future__ import annotations

import os
import statistics
import time

import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from branch_replay_jax.benchmarks.replay import (architecture_of, case_inputs, cpu_seconds, emitter, parse_case,
                                                 run_worker, serve_worker)

MODES = ("replay", "naive", "torch_naive", "prefix_grouper")
TORCH_MODES = ("torch_naive", "prefix_grouper")
PEER_MODULE = "branch_replay_jax.benchmarks.peer"


def _torch_model(config):
  """The transformers causal LM of config.model (the SmolLM2 GGUF or a .gguf path), float32, SDPA attention."""
  import torch
  from transformers import AutoModelForCausalLM
  from branch_replay_jax.models.loading import KNOWN_MODELS, smollm2_gguf_path
  path = smollm2_gguf_path() if config.model in KNOWN_MODELS else config.model
  if not path.endswith(".gguf"):
    raise ValueError(f"bench_peer: model={config.model!r}: the peer needs a GGUF model (transformers' gguf_file)")
  model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32, attn_implementation="sdpa")
  model.train()
  return model


def _group_tensors(config, case):
  """(prompt [P], completions [G, T], advantage [G], weights [G, T]) as torch tensors, the JAX steps' inputs."""
  import torch
  arrays, _, _ = case_inputs(config, case, architecture_of(config))
  p = int(arrays.prompt_len)
  br = arrays.branches
  as_t = lambda x, dt: torch.as_tensor(np.asarray(x), dtype=dt)
  return (as_t(arrays.prompt_ids[:p], torch.long), as_t(br.tokens, torch.long), as_t(br.advantage, torch.float32),
          as_t(br.weights * br.mask, torch.float32))


def _completion_logp(logits, targets):
  """[B, T] log-probs of targets under logits [B, T, V] (float32)."""
  import torch
  return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def _torch_naive_step(model, prompt, comps, adv, weights, m):
  """One GRPO loss + backward with the prompt repeated, m sequences per micro-batch; returns the loss."""
  import torch
  g, t = comps.shape
  p = prompt.shape[0]
  total = 0.0
  for start in range(0, g, m):
    c = comps[start:start + m]
    ids = torch.cat([prompt.expand(c.shape[0], p), c], dim=1)
    hidden = model.model(input_ids=ids).last_hidden_state[:, p - 1:p - 1 + t]
    logp = _completion_logp(model.lm_head(hidden), c)
    loss = -(adv[start:start + m, None] * weights[start:start + m] * logp).sum()
    loss.backward()
    total += float(loss)
  return total


def _prefix_grouper_step(model, prompt, comps, adv, weights):
  """One GRPO loss + backward on the packed group [prompt ; c_1 ; ... ; c_G] through PrefixGrouper."""
  import torch
  from prefix_grouper import PrefixGrouper
  g, t = comps.shape
  p = prompt.shape[0]
  pg = PrefixGrouper([[p] + [t] * g], device="cpu")
  ids = torch.cat([prompt, comps.reshape(-1)])[None]
  positions = torch.cat([torch.arange(p), (p + torch.arange(t)).repeat(g)])[None]
  hidden = model.model(input_ids=ids, position_ids=positions, prefix_grouper=pg).last_hidden_state
  # Suffix hidden states per completion with the prompt's last position prepended: [G, T + 1, d].
  _, _, suffix, _ = pg.split_output(hidden, include_prefix_last=1)
  logp = _completion_logp(model.lm_head(suffix[:, :t]), comps)
  loss = -(adv[:, None] * weights * logp).sum()
  loss.backward()
  return float(loss)


def _grouped_sdpa(q, k, v, padding_mask, scale):
  """SDPA of queries [B, H, Tq, D] over keys [B, Hkv, S, D], padding_mask [B, S] (True = real key), causal
  aligned bottom-right (query i sees key j iff j <= i + S - Tq; the suffix call's keys are [prompt ; own]);
  returns [B, Tq, H, D], the layout PrefixGrouper's `group` takes."""
  import torch
  tq, s = q.shape[2], k.shape[2]
  causal = torch.ones(tq, s, dtype=torch.bool).tril(diagonal=s - tq)
  mask = causal[None, None] & padding_mask[:, None, None, :].to(torch.bool)
  out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
  return out.transpose(1, 2).contiguous()


def _register_prefix_grouper_sdpa() -> str:
  """Register a transformers attention function that routes through PrefixGrouper with `_grouped_sdpa`
  (the package's own hook passes its 2-D padding masks to SDPA, which then is neither causal nor
  broadcastable: it is written for flash-attention's bottom-right causal kernels); returns its name."""
  from transformers import AttentionInterface

  def attention(module, query, key, value, attention_mask, *args, prefix_grouper, **kwargs):
    del attention_mask, args
    out = prefix_grouper.forward(lambda q, k, v, m: _grouped_sdpa(q, k, v, m, module.scaling), query, key, value)
    return out, None
  AttentionInterface.register("prefix_grouper_sdpa", attention)
  return "prefix_grouper_sdpa"


def _peer_worker(job: dict) -> dict:
  """One PyTorch mode of one case: warm-up, then `repeats` timed steps (wall and CPU seconds)."""
  import torch
  config = ml_collections.ConfigDict(job["config"])
  case = parse_case(config, job["case"])
  model = _torch_model(config)
  if job["mode"] == "prefix_grouper":
    model.set_attn_implementation(_register_prefix_grouper_sdpa())
    step = lambda *a: _prefix_grouper_step(model, *a)
  else:
    step = lambda *a: _torch_naive_step(model, *a, job["micro_batch"])
  inputs = _group_tensors(config, case)
  model.zero_grad(set_to_none=True)
  step(*inputs)   # warm-up, untimed
  times, cpu_times = [], []
  for _ in range(job["repeats"]):
    model.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    loss = step(*inputs)
    times.append(time.perf_counter() - t0)
    cpu_times.append(cpu_seconds() - c0)
  return {"mode": job["mode"], "micro_batch": job.get("micro_batch"), "seconds": statistics.median(times),
          "times": times, "cpu_times": cpu_times, "loss": loss, "torch": torch.__version__,
          "threads": torch.get_num_threads()}


def check_config(config) -> None:
  """ValueError naming the field for a bad config, before any compute."""
  for mode in config.modes:
    if mode not in MODES:
      raise ValueError(f"bench_peer: modes entry {mode!r} is not one of {MODES}")
  for field in ("rounds", "repeats", "naive_micro_batch", "replay_micro_batch"):
    if not isinstance(config[field], int) or config[field] < 1:
      raise ValueError(f"bench_peer: {field}={config[field]!r} must be a positive int")
  if not config.torch_micro_batches or any(not isinstance(m, int) or m < 1 for m in config.torch_micro_batches):
    raise ValueError(f"bench_peer: torch_micro_batches={config.torch_micro_batches!r} must be positive ints")
  if config.tree_cases or config.ppo_cases:
    raise ValueError("bench_peer: tree_cases and ppo_cases must be empty (prompt groups only)")
  if set(config.modes) & set(TORCH_MODES):
    try:
      import prefix_grouper, torch  # noqa: F401
    except ImportError as e:
      raise ValueError(f"bench_peer: modes {config.modes} need torch and prefix-grouper (pip install -e .[peer]): {e}")


def run_case(config, index: int, emit) -> dict:
  case = parse_case(config, index)
  shape = {"P": case["P"], "T": case["T"], "G": case["G"]}
  base = {"config": config.to_dict(), "case": index, "repeats": config.repeats}
  runs, load0 = {}, os.getloadavg()[0]
  torch_m = None
  for r in range(config.rounds):
    for mode in config.modes:
      if mode == "torch_naive":
        cands = [m for m in config.torch_micro_batches if case["G"] % m == 0] if torch_m is None else [torch_m]
        trials = {m: run_worker({**base, "mode": mode, "micro_batch": m}, module=PEER_MODULE) for m in cands}
        for m, out in trials.items():
          if "error" in out:
            raise RuntimeError(f"bench_peer: torch_naive m={m} failed: {out['error']}\n{out['stderr_tail']}")
          if len(trials) > 1:
            emit({**shape, "round": r, "mode": mode, "trial": True, "micro_batch": m, "seconds": out["seconds"]})
        torch_m = min(trials, key=lambda m: trials[m]["seconds"])
        out = trials[torch_m]
      else:
        m = config.naive_micro_batch if mode == "naive" else config.replay_micro_batch
        module = PEER_MODULE if mode in TORCH_MODES else "branch_replay_jax.benchmarks.replay"
        out = run_worker({**base, "mode": mode, "micro_batch": m}, module=module)
        if "error" in out:
          raise RuntimeError(f"bench_peer: {mode} failed: {out['error']}\n{out['stderr_tail']}")
      row = {**shape, "round": r, "mode": mode, "micro_batch": out.get("micro_batch") if mode != "prefix_grouper" else None, "seconds": out["seconds"],
             "cpu_s": statistics.median(out["cpu_times"]), "times": out["times"], "load_avg": os.getloadavg()[0]}
      emit(row)
      runs.setdefault(mode, []).append(row)
  med = {mode: {"s": statistics.median(x["seconds"] for x in rows), "cpu_s": statistics.median(x["cpu_s"] for x in rows)}
         for mode, rows in runs.items()}
  ratios = {}
  for a, b in (("replay", "prefix_grouper"), ("naive", "torch_naive"), ("replay", "torch_naive"), ("replay", "naive"),
               ("prefix_grouper", "torch_naive")):
    if a in med and b in med:
      ratios[f"{a}/{b}"] = {"s": med[a]["s"] / med[b]["s"], "cpu_s": med[a]["cpu_s"] / med[b]["cpu_s"]}
  summary = {**shape, "summary": True, "median": med, "ratios": ratios, "torch_naive_micro_batch": torch_m,
             "load_avg_before": load0, "load_avg_after": os.getloadavg()[0], "xla_flags": os.environ.get("XLA_FLAGS", "")}
  emit(summary)
  return summary


def main(argv):
  del argv
  if serve_worker(_peer_worker):
    return
  config = flags.FLAGS.config
  check_config(config)
  emit = emitter(config.output)
  for i in range(len(config.cases)):
    run_case(config, i, emit)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_peer.py", "Peer benchmark config.")
  flags.DEFINE_string("worker", "", "Internal: JSON job for one measurement in a fresh process.")
  app.run(main)
