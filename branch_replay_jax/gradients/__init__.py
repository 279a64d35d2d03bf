"""The step builder: a decoder's objective gradients and forward passes on groups and trees, for any
head (heads.py: policy, policy + critic), layout (replay, naive) and mesh (step.py); preference pairs'
two-pass gradient on top of it (preference.py)."""
