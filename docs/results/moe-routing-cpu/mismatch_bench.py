"""How often the trainer would route a sampled token otherwise than the sampler did: `routing_mismatch`, measured.

The random Qwen3-MoE of routing_bench.py (4 layers, 8 experts, 2 per token) samples G = 8 completions of up to 64
tokens of a 256-token prompt (`rollout.sampler.sample_group`, temperature 1, recording each token's experts); the
update's forward (`gradients.step.forward`, replay fused, and naive rows) then compares its own top 2 with the
recorded experts. Per compute dtype (float32, bfloat16) and seed: the fraction of recorded (layer, token) pairs that
differ, averaged over the trajectories (the step's metric). The sampler decodes one token at a time against a K/V
cache; the trainer runs the whole sequence: other shapes, other rounding.

    taskset -c 0 python docs/results/moe-routing-cpu/mismatch_bench.py > docs/results/moe-routing-cpu/mismatch.jsonl
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax.data.batches import group_arrays, recorded_routes
from branch_replay_jax.data.groups import group_from_padded
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models import Llama
from branch_replay_jax.models.config import tiny_config
from branch_replay_jax.rollout.sampler import sample_group

VOCAB, P, N, G = 512, 256, 64, 8


def main():
  cfg = tiny_config(vocab_size=VOCAB, arch="qwen3_moe", qk_norm=True, num_experts=8, experts_per_token=2,
                    expert_ffn_dim=256, num_layers=4, d_model=256, num_heads=4, num_kv_heads=2, head_dim=64,
                    max_positions=1024)
  f32 = Llama(cfg, rngs=nnx.Rngs(0))
  params = nnx.state(f32, nnx.Param)
  for dtype in (jnp.float32, jnp.bfloat16):
    model = Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    nnx.update(model, params)
    graphdef, state = nnx.split(model)
    for seed in range(3):
      prompt = np.random.default_rng(seed).integers(3, VOCAB, P)
      ro = sample_group(model, prompt, num_samples=G, max_new_tokens=N, key=jax.random.key(seed), temperature=1.0)
      group = group_from_padded(prompt, np.asarray(ro.tokens), np.asarray(ro.lengths), vocab_size=VOCAB,
                                max_positions=1024, completion_bucket=N)
      t = group.completion_ids.shape[1]
      batch = recorded_routes(group_arrays(group, weights=np.asarray(group.completion_mask, np.float32),
                                           advantage=np.zeros(G, np.float32)),
                              np.asarray(ro.prompt_routes), np.asarray(ro.routes))
      obj = lambda logp, br: (jnp.sum(logp * br.weights) * 0.0, {"kl": jnp.zeros(()), "clipped": jnp.zeros(())})
      for layout in ("replay", "naive"):
        _, aux, _ = jax.jit(lambda s, b: value_and_grad(Policy(), graphdef, s, b, obj, layout=layout))(state, batch)
        recorded = int((np.asarray(batch.branches.routes)[..., 0, 0] >= 0).sum()) + int(ro.prompt_routes.shape[0])
        print(json.dumps({"dtype": jnp.dtype(dtype).name, "seed": seed, "layout": layout, "G": G, "P": P,
                          "completion_tokens": int(np.asarray(ro.lengths).sum()), "T_bucket": t,
                          "recorded_tokens_prompt_once": recorded,
                          "routing_mismatch": float(np.sum(aux["routing_mismatch"]))}), flush=True)


if __name__ == "__main__":
  main()
