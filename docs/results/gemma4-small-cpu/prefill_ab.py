# Time sample_group with a long prompt and few new tokens (prefill-bound) on the E2B-layout directory.
import json, statistics, sys, time
import jax, numpy as np
from branch_replay_jax.models import load
from branch_replay_jax.rollout.sampler import sample_group
model, _ = load(sys.argv[1])
prompt = np.random.default_rng(0).integers(3, model.config.vocab_size, 2048)
times = []
for i in range(4):   # the first call compiles
  t0 = time.perf_counter()
  out = sample_group(model, prompt, num_samples=4, max_new_tokens=4, key=jax.random.key(i), temperature=1.0)
  jax.block_until_ready(out.tokens)
  times.append(time.perf_counter() - t0)
print(json.dumps({"P": 2048, "G": 4, "new_tokens": 4, "first_call_s": times[0], "median_s": statistics.median(times[1:]),
                  "times_s": times[1:], "tokens": np.asarray(out.tokens).tolist()}))
