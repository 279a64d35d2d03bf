"""One GRPO smoke step of a random Qwen3-MoE directory (2 layers, 4 experts, 2 per token, SmolLM2's tokenizer) with
routing replay and the load-balancing loss (0.01), the run-time exactness check on; prints its metrics as JSON.

  seq:  on a 2 x 2 x 2 mesh (data x branch x seq), the prompt split over seq;
  lora: on one device, LoRA adapters on the attention (experiments/grpo_smollm2_arith.py:lora_smoke).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \
    python docs/results/moe-seq-lora-cpu/loop.py {seq|lora}
"""
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
import pytest  # noqa: E402
from families import SMOLLM2_VOCAB, grpo_on_exported  # noqa: E402
from flax import nnx  # noqa: E402

from branch_replay_jax.models import Llama  # noqa: E402
from branch_replay_jax.models.config import tiny_config  # noqa: E402
from branch_replay_jax.models.lora import ATTENTION_TARGETS  # noqa: E402

CASES = {"seq": ("smoke", {"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2, "rollout.prompts_per_step": 2}),
         "lora": ("lora_smoke", {"lora.targets": ATTENTION_TARGETS, "train.micro_batch": 4})}
variant, overrides = CASES[sys.argv[1]]
cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
                  expert_ffn_dim=16, max_positions=2048, tie_embeddings=False)
with pytest.MonkeyPatch.context() as mp:
  record = grpo_on_exported(Llama(cfg, rngs=nnx.Rngs(0)), pathlib.Path(tempfile.mkdtemp()), mp, variant=variant,
                            **{"loss.router_aux_coef": 0.01, "model.routing_replay": True, **overrides})
keys = ("exactness_ok", "exactness_grad_rel_err", "exactness_loss_rel_err", "router_aux", "routing_mismatch", "loss",
        "grad_norm", "step_s")
print(json.dumps({"case": sys.argv[1], **{k: record[k] for k in keys if k in record}}))
