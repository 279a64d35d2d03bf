"""What the model-family tests (test_gemma.py, test_qwen3_5.py, test_moe.py) share: the transformers fixture's
reference, next-token log-probs, the off-policy GRPO objective and its jitted step, a group's arrays, GRPO on
an exported directory, a refusal before loading, the FSDP mesh step against naive groups, and LoRA adapters with
random B on a float64 model with their jitted step."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models import lora
from branch_replay_jax.models.llama import token_logprobs
from conftest import max_rel_err


SMOLLM2_VOCAB = 49152   # SmolLM2's tokenizer: what `grpo_on_exported` exports beside the model


def read_reference(fixture: str) -> dict:
  """reference.json of a tools/make_*_reference.py fixture."""
  with open(os.path.join(fixture, "reference.json")) as f:
    return json.load(f)


def next_logprobs(m, ids) -> np.ndarray:
  """[len(ids) - 1] log-probs of each next id under model m (one forward of the whole sequence)."""
  out = m(jnp.asarray([ids]), 0)
  w, axis = m.output_weights()
  return np.asarray(token_logprobs(out.hidden_btd[:, :-1], w, jnp.asarray([ids[1:]]), vocab_axis=axis,
                                   softcap=m.logit_softcap)[0])


def reference_error(m, item: dict) -> float:
  """max |log-prob of each next id under model m - the fixture's| for one of reference.json's inputs."""
  return float(np.abs(next_logprobs(m, item["input_ids"]) - np.asarray(item["next_token_logprobs"])).max())


def objective(logp, br):
  """GRPO's clipped objective with a KL term, off-policy (old log-probs given): every term has a gradient."""
  return obj.grpo_objective(logp, br, clip_eps=0.2, kl_coef=0.05, on_policy=False)


step = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3),
               static_argnames=("micro_batch", "schedule", "layout", "fused"))


def arrays_of(group, dtype, seed: int = 1):
  """A group's `RolloutBatch` with sequence-mean weights and random advantages, old and reference log-probs."""
  rng = np.random.default_rng(seed)
  g, t = group.completion_ids.shape
  return group_arrays(group, weights=obj.token_weights(group.lengths, t, mode="sequence_mean").astype(dtype),
                      advantage=rng.normal(size=g).astype(dtype),
                      old_logp=(-4.5 + 0.3 * rng.normal(size=(g, t))).astype(dtype),
                      ref_logp=(-4.5 + 0.3 * rng.normal(size=(g, t))).astype(dtype))


def grpo_on_exported(model, tmp_path, monkeypatch, experiment=None, variant: str = "smoke", **overrides) -> dict:
  """One GRPO smoke step (experiments/grpo_smollm2_arith.py:smoke, or `experiment`'s `variant`) on `model` exported with
  SmolLM2's tokenizer as a Hugging Face directory, with the run-time exactness check on and rewards that vary
  (`conftest.length_score`); returns the step's metrics record."""
  from conftest import experiment_config, length_score
  from experiments import grpo_smollm2_arith
  from branch_replay_jax.algorithms import grpo
  from branch_replay_jax.export import export_model
  from branch_replay_jax.models.loading import load_tokenizer
  from branch_replay_jax.rollout.tasks import Task
  monkeypatch.setattr(Task, "score", length_score)
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  assert len(tokenizer) == SMOLLM2_VOCAB == model.config.vocab_size
  model_dir = export_model(model, tokenizer, str(tmp_path / "hf"))
  (record,) = grpo.train(experiment_config(experiment or grpo_smollm2_arith, variant, tmp_path / "run", **{
      "model.name": model_dir, "eval.size": 0, "train.steps": 1, "train.exactness_check_every": 1, **overrides}))
  return record


def refused_before_loading(tmp_path, fixture: str, variant: str, overrides: dict, match: str) -> None:
  """GRPO's `variant` smoke experiment on the fixture directory (config.json alone: it has no tokenizer, so a
  load would fail otherwise) raises ValueError matching `match`."""
  from conftest import experiment_config
  from experiments import grpo_smollm2_arith
  from branch_replay_jax.algorithms import grpo
  with pytest.raises(ValueError, match=match):
    grpo.train(experiment_config(grpo_smollm2_arith, variant, tmp_path / "run", **{"model.name": fixture,
                                                                                      **overrides}))


def fsdp_step_equals_naive(graphdef, params, groups, head=POLICY, seq: int = 1, mode: str = "fsdp",
                           expert: str = "", mesh_graphdef=None) -> None:
  """Float64: the groups stacked over data x branch x seq = 2 x 2 x `seq` (4 or 8 of the 8 fake devices; the
  prompts split over seq) with parameters in layout `mode` (FSDP by default) and, with `expert`, a mixture of
  experts' experts split over that axis give the loss and summed gradient of the groups' naive steps
  (<= 1e-10), both through `head`; the mesh step through `mesh_graphdef` (default: graphdef)."""
  mesh_graphdef = graphdef if mesh_graphdef is None else mesh_graphdef
  from branch_replay_jax.distributed.mesh import make_mesh, pad_prompts, shard_batch, shard_params, stack_groups
  naive = jax.jit(lambda p, b: value_and_grad(head, graphdef, p, b, objective, layout="naive"))
  outs = [naive(params, a) for a in groups]
  naive_grads = jax.tree_util.tree_map(lambda *g: sum(g), *[o[2] for o in outs])
  mesh = make_mesh(2, 2, seq, devices=jax.devices()[:4 * seq])
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(groups, seq)), mesh)
    loss, _, grads = jax.jit(lambda p, b: value_and_grad(head, mesh_graphdef, p, b, objective, mesh=mesh,
                                                         micro_batch=1))(shard_params(params, mesh, mode, expert=expert),
                                                                         batch)
  assert float(loss) == pytest.approx(float(sum(o[0] for o in outs)), rel=1e-10)
  assert max_rel_err(grads, naive_grads) <= 1e-10


def sampler_routes(graphdef, params, arrays, rng, flip: float, unrecorded: float):
  """The group's routes as a sampler would record them: each real token's own experts per layer (from one naive
  forward), a `flip` fraction of the (layer, token) pairs swapped to another expert (a sampler that routed
  otherwise) and an `unrecorded` fraction of the completions' tokens -1 (none recorded). Returns (prompt_routes
  [P_pad, L, k], completion routes [G, T, L, k], flipped [G, P_pad + T, L] in naive-row layout, recorded mask)."""
  from branch_replay_jax.gradients.step import naive_batch
  tokens, valid, offset = naive_batch(arrays)
  own = np.asarray(nnx.merge(graphdef, params)(tokens, offset, valid_bt=valid).experts)     # [G, P_pad + T, L, k]
  e = nnx.merge(graphdef, params).config.num_experts
  p_pad, shift = arrays.prompt_ids.shape[0], arrays.prompt_ids.shape[0] - int(arrays.prompt_len)
  flip_mask = rng.random(own.shape[:3]) < flip
  flip_mask[:, p_pad:] &= np.asarray(arrays.branches.mask)[:, :, None]
  flip_mask[:, :p_pad] = flip_mask[:1, :p_pad]                                   # the prompt is one sequence
  flip_mask[:, :shift] = False
  other = lambda s: [s[0], min(x for x in range(e) if x not in s)]
  routes = own.copy()
  for g, t, layer in zip(*np.nonzero(flip_mask)):
    routes[g, t, layer] = other(list(own[g, t, layer]))
  routes[:, :shift] = -1
  skip = (rng.random(routes.shape[:2]) < unrecorded) & (np.arange(routes.shape[1]) >= p_pad)[None]
  routes[skip] = -1
  recorded = np.asarray(valid) & ~skip
  prompt = np.roll(routes[0, :p_pad], -shift, axis=0)
  return jnp.asarray(prompt), jnp.asarray(routes[:, p_pad:]), flip_mask & recorded[:, :, None], recorded


def tree_and_rows(tree, rng, end_share: bool = False):
  """(the tree's batch, its trajectories as naive rows, advantages) of `tree` with random GRPO fields: an
  advantage per trajectory, old and reference log-probs per node, sequence-mean weights (max length 16); with
  end_share, the nodes' shares of ending trajectories (the load-balancing loss's weights)."""
  from branch_replay_jax.data.batches import trajectory_group_arrays, tree_arrays
  from branch_replay_jax.data.trees import pad_tree
  adv = rng.normal(size=len(tree.ends))
  old = [(-4.5 + 0.3 * rng.normal(size=len(s))) for s in tree.segments]
  ref = [(-4.5 + 0.3 * rng.normal(size=len(s))) for s in tree.segments]
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean", max_length=16)
  per_node = {"weights": list(tree.node_weights(w)), "old_logp": old, "ref_logp": ref,
              **({"end_share": tree.end_shares()} if end_share else {})}
  rows = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": ref}, w, vocab_size=96, max_positions=128,
                                 completion_bucket=16, advantage=adv)
  return tree_arrays(pad_tree(tree), per_node, advantage=adv), rows, adv


def window_tree(rng):
  """A depth-3 tree over a vocabulary of 96 for the sliding-window families (tests/test_gemma.py, test_gemma4.py):
  a prompt of 5, then two nodes of 3-4 tokens, two children each of 2 or 4, two leaves each of 2 or 3: with a
  window of 4 a leaf token sees part of its parent and none of its grandparent or the prompt."""
  from branch_replay_jax.data.trees import tree_from_trajectories
  seg = lambda first, n: [first] + list(rng.integers(3, 96, n - 1))
  one = {a: seg(10 + a, 3 + a) for a in range(2)}
  two = {(a, b): seg(20 + b, 2 + 2 * b) for a in range(2) for b in range(2)}
  trajectories = [one[a] + two[a, b] + seg(30 + c, 2 + c) for a in range(2) for b in range(2) for c in range(2)]
  return tree_from_trajectories(list(rng.integers(3, 96, 5)), trajectories)


def ring_cache_equals_full_cache(model) -> None:
  """The group sampler's program (`sampler.generate_program`) on `model` rebuilt in float64, with its sliding layers'
  decode cache a ring of W - 1 slots (`window_kv.RingCache`) and with the whole cache: 4 samples of 14 tokens on
  a prompt of 7 (the fixtures' W = 4: the ring of 3 wraps four times), temperature 1. The same tokens, and
  log-probs equal to float64 rounding (<= 1e-12); the ring holds W - 1 slots."""
  from branch_replay_jax.models.window_kv import RingCache
  from branch_replay_jax.rollout.sampler import generate_program, bucketed_prompt_and_eos, init_cache
  graphdef, params = params64(model)
  w = model.config.sliding_window
  with jax.enable_x64(True):
    cache = init_cache(nnx.merge(graphdef, params), 4, 14, ring=True)
    assert isinstance(cache, RingCache) and cache.ring.valid.shape == (4, w - 1) and cache.full.valid.shape == (4, 14)
    padded, eos = bucketed_prompt_and_eos("test", np.arange(5, 12), None, np.asarray([], np.int64))
    args = (graphdef, params, jnp.asarray(padded), jnp.int32(7), jax.random.split(jax.random.key(3), 4),
            jnp.float32(1.0), jnp.float32(1.0), jnp.asarray(eos, jnp.int32), jnp.int32(0), None, jnp.float32(1.0))
    ring, full = (generate_program(*args, max_new_tokens=14, greedy=False, use_top_p=False, ring=r)
                  for r in (True, False))
    assert np.array_equal(ring[2], [14] * 4) and np.array_equal(ring[0], full[0])
    assert float(jnp.max(jnp.abs(ring[1] - full[1]))) <= 1e-12


def window_tree_equals_naive(graphdef, params) -> None:
  """Float64: `window_tree`'s depth-3 tree (seed 7) by depth-first replay (micro-batch 2) against its naive rows:
  the loss to 1e-12 relative and every gradient to 1e-10."""
  rng = np.random.default_rng(7)
  tree_batch, rows, _ = tree_and_rows(window_tree(rng), rng)
  ln, _, gn = step(graphdef, params, rows, objective, layout="naive")
  lt, _, gt = step(graphdef, params, tree_batch, objective, schedule="depth_first", micro_batch=2)
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10


def greedy_reproduces(model, reference: dict, min_gap: float) -> None:
  """The fixture's greedy continuation (transformers' argmax of full forwards, every top-1/top-2 logit gap above
  `min_gap`) equals our sampler's at temperature 0 (the K/V cache or recurrent state, one token at a time)."""
  from branch_replay_jax.rollout.sampler import sample_group
  g = reference["greedy"]
  assert min(g["top1_minus_top2"]) > min_gap
  out = sample_group(model, np.asarray(g["prompt_ids"]), num_samples=1, max_new_tokens=len(g["ids"]),
                     key=jax.random.key(0), temperature=0.0)
  assert np.asarray(out.tokens).tolist() == [g["ids"]]


def export_round_trip(model, fixture: str, tmp_path) -> None:
  """`model` exported and loaded back: the same config and parameters, and the tensors' names and shapes those
  transformers wrote in `fixture`."""
  from safetensors import safe_open
  from branch_replay_jax.export import export_model
  from branch_replay_jax.models.loading import load_hf_model
  export_model(model, None, str(tmp_path / "out"))
  back = load_hf_model(str(tmp_path / "out"))
  assert back.config == model.config
  want, got = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(back, nnx.Param))
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, got, want))
  shapes = lambda path: {k: f.get_slice(k).get_shape() for f in [safe_open(path, "np")] for k in f.keys()}
  assert shapes(str(tmp_path / "out" / "model.safetensors")) == shapes(os.path.join(fixture, "model.safetensors"))


def params64(model):
  """(graphdef, float64 params) of `model` rebuilt in float64 compute (x64 on while it runs)."""
  from branch_replay_jax.models.loading import build_model
  with jax.enable_x64(True):
    m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
    graphdef, params = nnx.split(m64)
    return graphdef, jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)


def adapted64(graphdef, params, spec):
  """(graphdef, adapters, base) of the float64 model (graphdef, params) with `spec`'s adapters, each B random (the
  zero init would leave the adapted model the base model, so a misplaced adapter would change nothing), float64."""
  with jax.enable_x64(True):
    m = nnx.merge(graphdef, params)
    lora.add_adapters(m, spec, rngs=nnx.Rngs(1))
    pairs = [(module, t) for t in spec.targets for module, _ in lora.target_weights(m, t)]
    for i, (module, name) in enumerate(pairs):
      b = getattr(module, name + "_lora_b")
      b[...] = 0.3 * jax.random.normal(jax.random.key(10 + i), b.shape, b.dtype)
    graphdef, adapters, base = lora.split(m)
    f64 = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), tree)
    return graphdef, f64(adapters), f64(base)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("layout", "micro_batch", "fused", "schedule"))
def lora_step(graphdef, adapters, base, batch, layout="replay", micro_batch=None, fused=None, schedule=None):
  """`step` with the base bound by `lora.WithBase` as a traced argument (as GRPO's step binds it)."""
  kw = {} if schedule is None else {"schedule": schedule}
  return value_and_grad(POLICY, lora.WithBase(graphdef, base), adapters, batch, objective, layout=layout,
                        micro_batch=micro_batch, fused=fused, **kw)


def lora_fsdp_step_equals_naive(graphdef, adapters, base, groups) -> None:
  """Float64: the groups over data x branch = 2 x 2, the frozen base and the adapters both FSDP-sharded (the base's
  stacks split and gathered inside the layer scan, never differentiated): the loss and the adapters' summed
  gradient equal the groups' naive steps' (<= 1e-10), and the gradient holds the adapters alone."""
  from branch_replay_jax.distributed.mesh import make_mesh, pad_prompts, shard_batch, shard_params, stack_groups
  outs = [lora_step(graphdef, adapters, base, g, layout="naive") for g in groups]
  want = jax.tree_util.tree_map(lambda *g: sum(g), *[o[2] for o in outs])
  mesh = make_mesh(2, 2, 1, devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(groups, 1)), mesh)
    step = jax.jit(lambda a, b, x: value_and_grad(POLICY, lora.WithBase(graphdef, b), a, x, objective, mesh=mesh,
                                                    micro_batch=1))
    loss, _, grads = step(shard_params(adapters, mesh, "fsdp"), shard_params(base, mesh, "fsdp"), batch)
  assert float(loss) == pytest.approx(float(sum(o[0] for o in outs)), rel=1e-10)
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(adapters), "only adapters differentiated"
  assert max_rel_err(grads, want) <= 1e-10
