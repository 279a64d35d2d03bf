"""PPO with a critic and branch replay on SmolLM2-135M-Instruct and reasoning-gym's basic_arithmetic.

The GRPO experiment's sampling, task and optimizer (experiments/grpo_smollm2_arith.py) with the
PPO plug-in of the training loop (branch_replay_jax/algorithms/ppo.py): a value head on the policy (or a separate critic trunk),
GAE advantages per token, clipped policy and value losses, epochs of minibatches.

  python -m branch_replay_jax.main --config=experiments/ppo_smollm2_arith.py          # default, 12 steps
  python -m branch_replay_jax.main --config=experiments/ppo_smollm2_arith.py:tree     # tree rollouts (4, 2, 2)
  python -m branch_replay_jax.main --config=experiments/ppo_smollm2_arith.py:smoke    # tiny model, 2 steps
  python -m branch_replay_jax.main --config=experiments/ppo_smollm2_arith.py:tree_smoke
"""

import ml_collections

from experiments import grpo_smollm2_arith


def get_config(arg=None):
  smoke = arg in ("smoke", "tree_smoke")
  c = grpo_smollm2_arith.get_config("smoke" if smoke else None)
  c.algorithm = "ppo"                     # main.py dispatches to branch_replay_jax.algorithms.ppo
  c.loss.kl_coef = 0.0                    # the PPO loss has no KL term (must be 0)
  del c.loss.advantage, c.loss.advantage_eps   # GAE advantages from the critic (ppo.gamma, ppo.lam)
  del (c.loss.clip_eps_low, c.loss.clip_eps_high, c.loss.importance_ratio, c.loss.logprob_temperature,  # GRPO's
       c.loss.mask_truncated, c.loss.overlong_buffer, c.loss.overlong_penalty, c.loss.router_aux_coef,   # options
       c.rollout.dynamic_sampling, c.rollout.max_prompt_draws, c.model.routing_replay)   # (algorithms/grpo.py;
  #                                                                   schema.py refuses them)
  # loss.rollout_correction and its fields stay (GRPO's values): PPO weighs its policy terms by them too.
  c.loss.clip_eps = 0.2                   # PPO's ratio clip epsilon (symmetric)
  c.loss.weighting = "group_token_mean"   # per-(token, trajectory) weights: mean over the group's tokens

  c.ppo = ml_collections.ConfigDict()
  c.ppo.critic = "value_head"             # value_head (scalar head on the policy's trunk) or separate (own trunk)
  c.ppo.epochs = 2                        # passes over each step's groups
  c.ppo.minibatches = 2                   # optimizer updates per pass; must divide rollout.prompts_per_step
  c.ppo.gamma = 1.0                       # GAE discount per token (arXiv 1506.02438 eq. 16)
  c.ppo.lam = 0.95                        # GAE lambda
  c.ppo.vf_coef = 0.5                     # weight of the value loss (arXiv 1707.06347 eq. 9)
  c.ppo.value_clip = 0.2                  # clip V - V_old to +-value_clip in the value loss (0 disables)
  c.ppo.whiten_advantages = True          # normalise advantages over the step's (token, trajectory) pairs
  c.ppo.critic_lr_scale = 10.0            # critic parameters' learning rate / train.learning_rate

  c.train.steps = 12
  c.train.exactness_check_every = 0       # GRPO / RLOO only (PPO's replay == naive: tests/test_ppo.py)
  c.checkpoint_every = 4
  c.run_dir = "runs/ppo_smollm2_arith"
  if arg in ("tree", "tree_smoke"):
    del c.rollout.group_size, c.rollout.max_new_tokens   # a tree's leaves are its group
    c.rollout.tree_fanouts = (2, 2) if smoke else (4, 2, 2)   # trajectories: 4 (smoke) or 16 per prompt
    c.rollout.segment_length = 4 if smoke else 12            # tokens per segment
    c.train.micro_batch = 2               # leaf siblings vmapped together (divides the last fan-out)
    c.run_dir = "runs/ppo_tree_smollm2_arith"
  if smoke:
    c.train.steps = 2
    c.checkpoint_every = 1
    c.run_dir = c.run_dir.replace("smollm2_arith", "smoke")
  if arg not in (None, "", "smoke", "tree", "tree_smoke"):
    raise ValueError(f"experiments/ppo_smollm2_arith.py: unknown variant {arg!r}; use '', 'tree', 'smoke' or "
                     "'tree_smoke'")
  return c
