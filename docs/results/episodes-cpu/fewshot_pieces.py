"""Where the few-shot (8,1,1) fused tree step loses against naive rows: the steps and their pieces timed side by side.

  LAYERS=30 taskset -c 1 python docs/results/episodes-cpu/fewshot_pieces.py tree      # or: naive, steps, attn
"""
import dataclasses, statistics, sys, time, os
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from branch_replay_jax import losses as obj
from branch_replay_jax.benchmarks.replay import GRPO_OBJECTIVE, cpu_seconds
from branch_replay_jax.benchmarks.episodes import parse_case, case_episodes
from branch_replay_jax.data.episodes import episode_group_arrays, episode_tree, episode_tree_arrays
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models import Llama
from branch_replay_jax.models.config import architecture_shape
from branch_replay_jax.kernels.reference import suffix_attention, KVBlock

layers = int(os.environ.get("LAYERS", "6"))
P, T, O = int(os.environ.get("P", 2048)), 32, 32
cfg = dataclasses.replace(architecture_shape("smollm2-135m"), max_positions=1 << 24, num_layers=layers)
model = Llama(cfg, dtype=jnp.float32, remat="none", rngs=nnx.Rngs(0))
graphdef, params = nnx.split(model)
case = parse_case((P, T, O, "8,1,1"))
eps = case_episodes(case, cfg.vocab_size, 0)
g = 8
adv = np.asarray(obj.group_advantages(jnp.asarray(np.random.default_rng(0).normal(size=g), jnp.float32)))
tree = episode_tree(eps)
w = obj.trajectory_weights(tree.model_lengths(), mode="sequence_mean").astype(np.float32)
longest = max(len(e.tokens()) for e in eps)
naive = episode_group_arrays(eps, adv, w, vocab_size=cfg.vocab_size, max_positions=cfg.max_positions,
                             prompt_bucket=P, completion_bucket=longest)
tarr = episode_tree_arrays(tree, adv, w, prompt_bucket=P, vocab_size=cfg.vocab_size, max_positions=cfg.max_positions)
print("naive tokens", naive.branches.tokens.shape, "tree levels", [l.tokens.shape for l in tarr.levels], flush=True)

def timeit(name, f, *args, reps=3):
  c = jax.jit(f).lower(*args).compile()
  jax.block_until_ready(c(*args))
  ts, cs = [], []
  for _ in range(reps):
    t0, c0 = time.perf_counter(), cpu_seconds()
    jax.block_until_ready(c(*args)); ts.append(time.perf_counter() - t0); cs.append(cpu_seconds() - c0)
  print(f"{name:40s} wall {statistics.median(ts):7.3f}  cpu {statistics.median(cs):7.3f}", flush=True)
  return statistics.median(ts)

which = sys.argv[1:] or ["steps", "attn"]
if "tree" in which:
  timeit("tree fused", lambda p, a: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, micro_batch=8, logprob_chunk=128), params, tarr, reps=2)
if "naive" in which:
  timeit("naive mb2", lambda p, a: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, layout="naive", micro_batch=2, logprob_chunk=128), params, naive, reps=int(os.environ.get("REPS", 2)))
if "steps" in which:
  for m in (2, 8):
    timeit(f"naive mb{m}", lambda p, a, m=m: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, layout="naive", micro_batch=m, logprob_chunk=128), params, naive)
  timeit("tree fused", lambda p, a: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, micro_batch=8, logprob_chunk=128), params, tarr)
  timeit("tree nested", lambda p, a: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, micro_batch=8, fused=False, logprob_chunk=128), params, tarr)
if "attn" in which:
  H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  r = np.random.default_rng(0)
  mk = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  def loss_att(q, k, v, anc=()):
    def f(q, k, v, *anc):
      blocks = [KVBlock(anc[i], anc[i+1], jnp.ones(anc[i].shape[:2], bool)) for i in range(0, len(anc), 2)]
      o, _ = suffix_attention(q, blocks, KVBlock(k, v, jnp.ones(k.shape[:2], bool)))
      return jnp.sum(o * o)
    return jax.value_and_grad(f, argnums=tuple(range(3 + len(anc))))(q, k, v, *anc)
  L = P + 5 * T
  timeit("attn naive 2 rows x L (x4 = 8 rows)", lambda q, k, v: loss_att(q, k, v), mk(2, L, H, D), mk(2, L, Hkv, D), mk(2, L, Hkv, D))
  timeit("attn prompt 1 x P", lambda q, k, v: loss_att(q, k, v), mk(1, P, H, D), mk(1, P, Hkv, D), mk(1, P, Hkv, D))
  timeit("attn rows 8 x 160 on P", lambda q, k, v, ak, av: loss_att(q, k, v, (ak, av)), mk(8, 5*T, H, D), mk(8, 5*T, Hkv, D), mk(8, 5*T, Hkv, D), mk(1, P, Hkv, D), mk(1, P, Hkv, D))
  dm = cfg.dim
  f = cfg.ffn_dim
  def mlp(x, w1, w2, w3):
    def fn(x, w1, w2, w3):
      return jnp.sum((jax.nn.silu(x @ w1) * (x @ w3)) @ w2)
    return jax.value_and_grad(fn, argnums=(0, 1, 2, 3))(x, w1, w2, w3)
  timeit("mlp 2 x L rows (x4)", mlp, mk(2, L, dm), mk(dm, f), mk(f, dm), mk(dm, f))
  timeit("mlp P", mlp, mk(1, P, dm), mk(dm, f), mk(f, dm), mk(dm, f))
  timeit("mlp 8 x 160", mlp, mk(8, 5*T, dm), mk(dm, f), mk(f, dm), mk(dm, f))
  def mlp_joined(xp, xr, w1, w2, w3):
    def fn(xp, xr, w1, w2, w3):
      x = jnp.concatenate([xp.reshape(-1, dm), xr.reshape(-1, dm)])
      return jnp.sum((jax.nn.silu(x @ w1) * (x @ w3)) @ w2)
    return jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4))(xp, xr, w1, w2, w3)
  timeit("mlp P and 8 x 160 joined", mlp_joined, mk(1, P, dm), mk(8, 5*T, dm), mk(dm, f), mk(f, dm), mk(dm, f))
