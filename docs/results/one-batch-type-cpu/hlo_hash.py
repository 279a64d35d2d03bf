"""Hashes of the optimized HLO of the group replay step (fused value_and_grad and make_train_step, GRPO objective)
and of a tree's (both schedules) on the tiny model, normalised so that two checkouts compare by program: the
metadata, the source-location tables (file paths, line numbers) and the group's parameter names (a group's
fields were named ..branches_.., now ..levels_0__..: the same arrays) are left out.
Run from a checkout: `cd CHECKOUT && python docs/results/one-batch-type-cpu/hlo_hash.py`."""
import hashlib, functools, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "tests")
from conftest import tiny_model, random_group
from branch_replay_jax import losses as obj
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.data.batches import group_arrays
import re


def normal(text: str) -> str:
  text = re.sub(r'metadata=\{[^}]*\}', '', text).replace("levels_0__", "branches_")
  return "\n".join(line for line in text.splitlines() if not re.match(r'^\d+ ("|\{)', line))


graphdef, params = tiny_model()
group = random_group([5, 7, 3, 8])
g = group.completion_ids.shape[0]
batch = group_arrays(group, weights=group.completion_mask.astype(np.float32), advantage=np.arange(g, dtype=np.float32),
                     old_logp=np.zeros(group.completion_ids.shape, np.float32), ref_logp=np.zeros(group.completion_ids.shape, np.float32))
objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
f = jax.jit(lambda p, b: value_and_grad(Policy(), graphdef, p, b, objective))
text = f.lower(params, batch).compile().as_text()
import re
text = normal(text)
print(hashlib.sha256(text.encode()).hexdigest()[:16], len(text))
import optax
from branch_replay_jax.gradients.step import make_train_step
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
step = make_train_step(Policy(), graphdef, tx, objective)
stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), batch)
text = step.lower(params, tx.init(params), stacked, 2).compile().as_text()
text = normal(text)
print("train_step", hashlib.sha256(text.encode()).hexdigest()[:16], len(text))
from branch_replay_jax.data.batches import tree_arrays
from branch_replay_jax.data.trees import RolloutTree, pad_tree
tree = RolloutTree((np.array([1, 2, 3, 4, 5]), np.array([4, 5, 6]), np.array([6, 7]), np.array([7]), np.array([8, 9, 10])),
                   (-1, 0, 1, 1, 0), (2, 3, 4))
padded = pad_tree(tree)
per_node = {"weights": [np.ones((len(s), 3), np.float32) for s in tree.segments], "old_logp": [np.zeros(len(s), np.float32) for s in tree.segments], "ref_logp": [np.zeros(len(s), np.float32) for s in tree.segments]}
tb = tree_arrays(padded, per_node, advantage=np.array([0.5, -0.5, 1.0], np.float32))
for sched in ("depth_first", "level"):
  f = jax.jit(lambda p, b: value_and_grad(Policy(), graphdef, p, b, objective, schedule=sched))
  text = normal(f.lower(params, tb).compile().as_text())
  print("tree", sched, hashlib.sha256(text.encode()).hexdigest()[:16], len(text))
