"""Preference pairs (DPO, IPO) on shared prompts: layout and the exact two-pass replay gradient.

Layout. Pairs whose prompts have the same token ids form one group (a tree of depth 1); the
group's branches are its DISTINCT completions, so a prompt shared by k pairs runs once for up
to 2k completions, and a completion shared by two pairs runs once too:

    pair 0: x  -> (y_w0, y_l0)         group 0: prompt x    branches [y_w0, y_l0, y_w1]
    pair 1: x  -> (y_w1, y_l0)         group 1: prompt x'   branches [y_w2, y_l2]
    pair 2: x' -> (y_w2, y_l2)         chosen = [0, 2, 3], rejected = [1, 1, 4]  (flat branch ids)

Gradient. The DPO loss L(S) = mean_k ℓ(S_{w_k}, S_{l_k}) couples a completion's tokens only
through its log-prob sum S_i = Σ_t logp_{i,t}(θ) (losses.dpo_loss; IPO's mean S_i / |y_i| is
the sum over a constant length, so the same holds). By the chain rule

    dL/dθ = Σ_i c_i dS_i/dθ,   c_i = ∂L/∂S_i,

which is the gradient of the LINEAR surrogate Σ_i c_i S_i(θ) with c held constant. So:
  pass 1: forward-only replay (gradients.step.forward) gives every S_i; c = jax.grad of L w.r.t.
          the sums (closed form, [N] scalars);
  pass 2: branch replay (gradients.step.value_and_grad) of the token-local objective
          -Σ_t w_{i,t} logp_{i,t} with w_{i,t} = -c_i on real tokens (losses.weighted_logprob_loss).
The gradient equals that of the DPO loss exactly (up to float rounding order); the loss
reported is L itself, not the surrogate's value. Pass 1 costs one extra forward of the unique
positions; in exchange pass 2's memory is bounded by a micro-batch of branches, whatever G.

Naive counterpart (what TRL does): every pair's two sequences with the prompt repeated
([2K, P + T] tokens), the loss of each micro-batch of pairs differentiated directly.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from branch_replay_jax import losses as obj
from branch_replay_jax.core.accumulate import fit_micro_batch, merge_micro_batches, scan_value_and_grad, split_micro_batches
from branch_replay_jax.data.batches import RolloutBatch, Segments, group_arrays
from branch_replay_jax.data.counts import group_counts
from branch_replay_jax.data.groups import bucket_length, make_group
from branch_replay_jax.distributed import mesh as meshes
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import apply_update, forward, value_and_grad


@dataclasses.dataclass(frozen=True)
class PreferencePair:
  """Token ids of one preference pair: prompt x, chosen completion y_w, rejected completion y_l (1-D int)."""
  prompt_ids: np.ndarray
  chosen_ids: np.ndarray
  rejected_ids: np.ndarray


@dataclasses.dataclass
class PreferenceBatch:
  """K pairs laid out for replay (one group per distinct prompt) and for the naive step.

  groups: one group (`data.batches.RolloutBatch`, rows) per distinct prompt (branches: the prompt's distinct
    completions; pass 2 adds their weights [G_j, T_j]).
  chosen, rejected: [K] int, each pair's completions as indices into the concatenation of all
    groups' branches (group 0's first, then group 1's, ...).
  naive: the pairs stacked for the naive step, a group's RolloutBatch with a leading axis K: prompt_ids
    [K, P_pad], prompt_len [K], branches.tokens / .mask [K, 2, T] (row 0 chosen, row 1 rejected).
  counts: token_positions_naive = Σ_k (2 P_k + |y_w| + |y_l|), token_positions_computed =
    Σ_groups (P + Σ distinct completion lengths) (tokens, real positions only).
  """
  groups: list[RolloutBatch]
  chosen: np.ndarray
  rejected: np.ndarray
  naive: RolloutBatch
  counts: dict

  @property
  def num_pairs(self) -> int:
    return int(self.chosen.shape[0])


def make_batch(pairs: Sequence[PreferencePair], *, vocab_size: int, max_positions: int,
               pad_id: int = 0) -> PreferenceBatch:
  """Group pairs by prompt, dedupe completions, pad (buckets as `data.groups.make_group`).

  Raises:
    ValueError: no pairs, a pair whose chosen and rejected ids are equal (naming its index), or
      anything `data.groups.make_group` raises (empty sequences, ids outside [0, vocab_size), too long).
  """
  if not pairs:
    raise ValueError("make_batch: no preference pairs")
  as_ids = lambda x: tuple(int(t) for t in np.asarray(x).reshape(-1))
  prompts: dict[tuple, list[tuple]] = {}
  for k, pair in enumerate(pairs):
    if as_ids(pair.chosen_ids) == as_ids(pair.rejected_ids):
      raise ValueError(f"make_batch: pairs[{k}] has identical chosen and rejected completions")
    comps = prompts.setdefault(as_ids(pair.prompt_ids), [])
    for c in (as_ids(pair.chosen_ids), as_ids(pair.rejected_ids)):
      if c not in comps:
        comps.append(c)
  groups, flat, offset, computed = [], {}, 0, 0
  for prompt, comps in prompts.items():
    group = make_group(prompt, comps, vocab_size=vocab_size, max_positions=max_positions, pad_id=pad_id)
    groups.append(group_arrays(group))
    flat.update({(prompt, c): offset + i for i, c in enumerate(comps)})
    offset += len(comps)
    computed += group_counts(group.prompt_len, group.lengths)["token_positions_computed"]
  keys = [(as_ids(p.prompt_ids), as_ids(p.chosen_ids), as_ids(p.rejected_ids)) for p in pairs]
  chosen = np.array([flat[(x, w)] for x, w, _ in keys])
  rejected = np.array([flat[(x, l)] for x, _, l in keys])
  p_bucket = bucket_length(max(len(x) for x, _, _ in keys))
  t_bucket = bucket_length(max(max(len(w), len(l)) for _, w, l in keys), minimum=8)
  naive = [group_arrays(make_group(x, [w, l], vocab_size=vocab_size, max_positions=max_positions, pad_id=pad_id,
                                   prompt_bucket=p_bucket, completion_bucket=t_bucket)) for x, w, l in keys]
  naive = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *naive)
  naive_positions = sum(2 * len(x) + len(w) + len(l) for x, w, l in keys)
  return PreferenceBatch(groups, chosen, rejected, naive,
                         {"token_positions_naive": naive_positions, "token_positions_computed": computed})


POLICY = Policy()


def surrogate_objective(logp, branch: Segments):
  """Pass 2's token-local objective (a `gradients.heads.Policy` objective): (-Σ_t w_t logp_t, 0) with
  w = branch.weights [T] (= -c_i on completion i's real tokens, 0 on padding)."""
  return obj.weighted_logprob_loss(logp, branch.weights), jnp.zeros((), logp.dtype)


def _mean_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta, loss_type, label_smoothing,
               chosen_lengths, rejected_lengths):
  losses, metrics = obj.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta,
                                 loss_type=loss_type, label_smoothing=label_smoothing,
                                 chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
  return jnp.mean(losses), metrics


class ReplaySteps:
  """Jitted pieces of the two-pass replay step, on one device or a mesh; each compiles once per shape.

    steps = ReplaySteps(graphdef, mesh=None, micro_batch=2)
    layout = steps.layout(batch)                      # once per batch
    loss, metrics, grads = steps.value_and_grad(params, layout, steps.flat_sums(ref_params, layout), beta=0.1)

  One device: the layout is the batch's groups (one per distinct prompt), each run by itself. A mesh
  (`distributed.mesh.make_mesh`; call inside `jax.set_mesh(mesh)` with parameters placed by
  `shard_params`): the groups padded to one shape (`distributed.mesh.pad_groups`: zero-weight
  padding, so loss and gradient are unchanged) and stacked into one batch.
  sums(params, unit) -> the unit's completions' log-prob sums (pass 1, forward only);
  surrogate_grad(params, unit) -> grads of Σ_i c_i S_i, with -c_i in unit.branches.weights (pass 2).
  micro_batch: completions per scan step on each device, the largest divisor of G (G' / branch) not above it.
  """

  def __init__(self, graphdef, *, mesh=None, micro_batch: int = 1, logprob_chunk: int = 256):
    self.mesh = mesh
    sums, grad = _passes(graphdef, mesh, micro_batch, logprob_chunk)
    if mesh is None:
      self.sums, self.surrogate_grad = jax.jit(sums), jax.jit(grad)
      return
    # Both passes take the stacked batch on the host and place it (shard_batch: with several
    # processes, each places its rows of the whole batch every process holds).
    sums_jit, grad_jit = jax.jit(sums), jax.jit(grad)
    self.sums = lambda p, b: sums_jit(p, meshes.shard_batch(b, mesh))
    self.surrogate_grad = lambda p, b: grad_jit(p, meshes.shard_batch(b, mesh))

  def layout(self, batch: PreferenceBatch) -> tuple[list[RolloutBatch], np.ndarray, np.ndarray]:
    """`replay_layout` on this mesh."""
    return replay_layout(batch, self.mesh)

  def flat_sums(self, params, layout) -> jax.Array:
    """[N] log-prob sums of the layout's completions (0 for a mesh's padding), in its indexing."""
    return jnp.concatenate([self.sums(params, u).reshape(-1) for u in layout[0]])

  def value_and_grad(self, params, layout, ref_sums: jax.Array, *, beta: float,
                     loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """(loss, metrics [K], grads) of mean_k ℓ_k by the two-pass scheme in the module docstring.

    ref_sums: [N] the reference's `flat_sums` on the same layout (frozen; compute once per batch).
    loss_type, label_smoothing: as `objectives.dpo_loss` (completion lengths come from the batch).
    """
    units, chosen, rejected = layout
    return two_pass_value_and_grad(self.sums, self.surrogate_grad, params, units, chosen, rejected, ref_sums,
                                   beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)


def replay_layout(batch: PreferenceBatch, mesh=None) -> tuple[list[RolloutBatch], np.ndarray, np.ndarray]:
  """(units, chosen [K], rejected [K]): the groups to run, each pair's completions as indices into
  the units' completions flattened in order (`two_pass_value_and_grad`). On a mesh, one unit: the
  padded groups stacked [B', G', ...] on the host."""
  if mesh is None:
    return list(batch.groups), np.asarray(batch.chosen), np.asarray(batch.rejected)
  padded, index = meshes.pad_groups(batch.groups, mesh)
  return [jax.device_get(meshes.stack_groups(padded))], index[batch.chosen], index[batch.rejected]


def _passes(graphdef, mesh, micro_batch: int, logprob_chunk: int):
  """(sums(params, unit), surrogate_grad(params, unit)): the two passes on one unit, untraced. On a mesh
  the sums [B, G'] come back replicated (the loss gathers the pairs' sums from them; the weights are
  computed off the mesh, replicated)."""
  branch = 1 if mesh is None else mesh.shape["branch"]
  mb = lambda a: fit_micro_batch(micro_batch, a.branches.tokens.shape[-2] // branch)
  def sums(p, a):
    s = forward(POLICY, graphdef, p, a, mesh=mesh, micro_batch=mb(a), logprob_chunk=logprob_chunk).sum(-1)
    return s if mesh is None else jax.sharding.reshard(s, P())
  grad = lambda p, a: value_and_grad(POLICY, graphdef, p, a, surrogate_objective, mesh=mesh, micro_batch=mb(a),
                                     logprob_chunk=logprob_chunk)[2]
  return sums, grad


def make_preference_step(graphdef, tx, *, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                         layout: str = "replay", mesh=None, micro_batch: int = 1, logprob_chunk: int = 256):
  """One jitted DPO / IPO optimizer step: the reference's log-prob sums, the loss gradient and the
  optax update `tx` in ONE program (`gradients.step.apply_update`, the tail of every train step).

      step = make_preference_step(graphdef, tx, beta=0.1)
      params, opt_state, out = step(params, ref_params, opt_state, batch)   # batch: a PreferenceBatch

  layout "replay": the two-pass replay of the module docstring on `ReplaySteps.layout`'s units (one
  group per distinct prompt on one device; on a mesh, the groups padded and stacked, placed by
  `shard_batch`); "naive": every pair's two full sequences (`naive_value_and_grad`, one device).
  out: {"loss": L (the DPO loss, not the surrogate's value), "metrics": `losses.dpo_loss`'s per pair
  [K], "grad_norm": ||dL/dθ||_2}. params and opt_state are donated (the caller must not read the
  arrays it passed in); ref_params are not. Each set of unit shapes (and pair count K) is one program;
  `gradients.step.compiled_programs(step.program)` counts them.

  Raises:
    ValueError: layout not "replay" or "naive", or "naive" with a mesh.
  """
  if layout not in ("replay", "naive"):
    raise ValueError(f"make_preference_step: layout={layout!r} is not one of ('replay', 'naive')")
  if layout == "naive" and mesh is not None:
    raise ValueError("make_preference_step: layout='naive' runs on one device; the mesh step is replay's")
  options = dict(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
  if layout == "naive":
    def naive_step(params, ref_params, opt_state, naive):
      ref = naive_ref_sums(graphdef, ref_params, naive, micro_batch=micro_batch, logprob_chunk=logprob_chunk)
      loss, metrics, grads = naive_value_and_grad(graphdef, params, naive, ref, micro_batch=micro_batch,
                                                  logprob_chunk=logprob_chunk, **options)
      params, opt_state, grad_norm = apply_update(tx, params, opt_state, grads)
      return params, opt_state, {"loss": loss, "metrics": metrics, "grad_norm": grad_norm}
    program = jax.jit(naive_step, donate_argnums=(0, 2))
    step = lambda params, ref_params, opt_state, batch: program(params, ref_params, opt_state, batch.naive)
    step.program = program
    return step

  sums, grad = _passes(graphdef, mesh, micro_batch, logprob_chunk)

  def replay_step(params, ref_params, opt_state, units, chosen, rejected, lengths):
    ref = jnp.concatenate([sums(ref_params, u).reshape(-1) for u in units])
    loss, metrics, grads = two_pass_value_and_grad(sums, grad, params, units, chosen, rejected, ref, lengths=lengths,
                                                   **options)
    params, opt_state, grad_norm = apply_update(tx, params, opt_state, grads)
    return params, opt_state, {"loss": loss, "metrics": metrics, "grad_norm": grad_norm}
  program = jax.jit(replay_step, donate_argnums=(0, 2))

  def step(params, ref_params, opt_state, batch: PreferenceBatch):
    units, chosen, rejected = replay_layout(batch, mesh)
    lengths = np.concatenate([np.asarray(u.branches.mask).sum(-1).reshape(-1) for u in units])   # on the host
    if mesh is not None:
      units = [meshes.shard_batch(u, mesh) for u in units]
    return program(params, ref_params, opt_state, list(units), jnp.asarray(chosen), jnp.asarray(rejected),
                   jnp.asarray(lengths))
  step.program = program
  return step


def two_pass_value_and_grad(sums_fn, surrogate_grad_fn, params, units: Sequence[RolloutBatch], chosen, rejected,
                            ref_sums: jax.Array, *, beta: float, loss_type: str = "sigmoid",
                            label_smoothing: float = 0.0, lengths=None):
  """(loss, metrics [K], grads) of mean_k ℓ_k by the two-pass scheme of the module docstring, on any
  layout of the completions.

  Args:
    sums_fn: (params, unit) -> the unit's completions' log-prob sums, shaped like its
      branches.mask less the token axis (pass 1, forward only; e.g. `ReplaySteps.sums`).
    surrogate_grad_fn: (params, unit with branches.weights) -> grads of Σ_i -Σ_t w_{i,t} logp_{i,t}
      (pass 2, `surrogate_objective`).
    units: groups: one per group ([G_j, T_j] completions), or groups stacked [B, G, T] on a
      device mesh (`ReplaySteps` with a mesh); their completions in order
      (row-major) make the flat completion axis [N].
    chosen, rejected: [K] int, each pair's completions on that flat axis.
    ref_sums: [N] the reference's sums on the same axis (frozen; compute once per batch).
    loss_type, label_smoothing: as `objectives.dpo_loss` (completion lengths from the masks).
    lengths: [N] the completions' lengths on the flat axis (None: from the units' masks; a mesh's
      caller passes them from its host arrays, unsharded).

  A completion no pair names (a mesh's padding) gets c_i = 0: zero weight, no gradient.
  """
  sums = jnp.concatenate([sums_fn(params, u).reshape(-1) for u in units])
  if lengths is None:
    lengths = jnp.concatenate([jnp.sum(u.branches.mask, axis=-1).reshape(-1) for u in units])
  lengths = jnp.asarray(lengths)
  c, r = jnp.asarray(chosen), jnp.asarray(rejected)
  (loss, metrics), (d_chosen, d_rejected) = jax.value_and_grad(_mean_loss, argnums=(0, 1), has_aux=True)(
      sums[c], sums[r], ref_sums[c], ref_sums[r], beta=beta, loss_type=loss_type,
      label_smoothing=label_smoothing, chosen_lengths=lengths[c], rejected_lengths=lengths[r])
  coef = jnp.zeros_like(sums).at[c].add(d_chosen).at[r].add(d_rejected)   # c_i = ∂L/∂S_i
  grads, start = None, 0
  for unit in units:
    br = unit.branches
    shape = br.mask.shape[:-1]
    n = int(np.prod(shape))
    weights = jnp.where(br.mask, -coef[start:start + n].reshape(shape)[..., None], 0.0)
    start += n
    gr = surrogate_grad_fn(params, unit.replace(levels=(br.replace(weights=weights),)))
    grads = gr if grads is None else jax.tree_util.tree_map(jnp.add, grads, gr)
  return loss, metrics, grads


def _pair_sums(graphdef, params, naive_mb, chunk):
  """[m, 2] log-prob sums of m pairs (row 0 chosen, row 1 rejected) from full sequences."""
  return jax.vmap(lambda a: forward(POLICY, graphdef, params, a, layout="naive", logprob_chunk=chunk).sum(-1))(naive_mb)


def naive_ref_sums(graphdef, params, naive: RolloutBatch, *, micro_batch: int = 1,
                   logprob_chunk: int = 256) -> jax.Array:
  """[K, 2] reference log-prob sums of the stacked pairs (`PreferenceBatch.naive`), forward only."""
  k = naive.prompt_len.shape[0]
  m = fit_micro_batch(micro_batch, k)
  _, sums = jax.lax.scan(lambda _, mb: (None, _pair_sums(graphdef, params, mb, logprob_chunk)), None,
                         split_micro_batches(naive, m))
  return sums.reshape(k, 2)


def naive_value_and_grad(graphdef, params, naive: RolloutBatch, ref_sums_k2: jax.Array, *, beta: float,
                         loss_type: str = "sigmoid", label_smoothing: float = 0.0, micro_batch: int = 1,
                         logprob_chunk: int = 256):
  """(loss, metrics [K], grads) of mean_k ℓ_k, differentiated directly on full sequences.

  Each pair's loss depends on its own two sequences only, so micro-batches of `micro_batch`
  pairs (largest divisor of K not above it) are differentiated one `lax.scan` step at a time.

  Args:
    naive: `PreferenceBatch.naive`; ref_sums_k2: [K, 2] from `naive_ref_sums` on the reference.
    loss_type, label_smoothing: as `objectives.dpo_loss` (completion lengths come from the masks).
  """
  k = naive.prompt_len.shape[0]
  m = fit_micro_batch(micro_batch, k)

  def mb_loss(p, mb):
    arrays, ref = mb
    s = _pair_sums(graphdef, p, arrays, logprob_chunk)
    n = arrays.branches.mask.sum(-1)
    losses, metrics = obj.dpo_loss(s[:, 0], s[:, 1], ref[:, 0], ref[:, 1], beta=beta, loss_type=loss_type,
                                   label_smoothing=label_smoothing, chosen_lengths=n[:, 0], rejected_lengths=n[:, 1])
    return jnp.sum(losses) / k, metrics

  carry = (jnp.zeros((), ref_sums_k2.dtype), jax.tree_util.tree_map(jnp.zeros_like, params))
  (loss, grads), metrics = scan_value_and_grad(mb_loss, params, split_micro_batches((naive, ref_sums_k2), m), carry)
  return loss, merge_micro_batches(metrics, k), grads
