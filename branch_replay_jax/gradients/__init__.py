"""A decoder's log-probs and objective gradients on groups and trees, replay and naive: the policy
(logprobs.py), policy + critic (actor_critic.py), preference pairs (preference.py)."""
