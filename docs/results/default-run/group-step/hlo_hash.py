"""Hash of the optimized HLO of the fused group replay step (value_and_grad, GRPO objective) on the tiny model."""
import hashlib, functools, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "tests")
from conftest import tiny_model, random_group
from branch_replay_jax import losses as obj
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.data.batches import group_arrays
graphdef, params = tiny_model()
group = random_group([5, 7, 3, 8])
g = group.completion_ids.shape[0]
batch = group_arrays(group, weights=group.completion_mask.astype(np.float32), advantage=np.arange(g, dtype=np.float32),
                     old_logp=np.zeros(group.completion_ids.shape, np.float32), ref_logp=np.zeros(group.completion_ids.shape, np.float32))
objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
f = jax.jit(lambda p, b: value_and_grad(Policy(), graphdef, p, b, objective))
text = f.lower(params, batch).compile().as_text()
import re
text = re.sub(r'metadata=\{[^}]*\}', '', text)
print(hashlib.sha256(text.encode()).hexdigest()[:16], len(text))
import optax
from branch_replay_jax.gradients.step import make_train_step
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
step = make_train_step(Policy(), graphdef, tx, objective)
stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), batch)
text = step.lower(params, tx.init(params), stacked, 2).compile().as_text()
text = re.sub(r'metadata=\{[^}]*\}', '', text)
print("train_step", hashlib.sha256(text.encode()).hexdigest()[:16], len(text))
