"""Llama-family decoders (Flax NNX) and their weight loaders."""

from branch_replay_jax.models.config import Llama3RopeScaling, ModelConfig, tiny_config
from branch_replay_jax.models.llama import Llama, SegmentOutput, token_logprobs
from branch_replay_jax.models.loading import encode_chat, load

__all__ = ["Llama", "Llama3RopeScaling", "ModelConfig", "SegmentOutput", "encode_chat", "load", "tiny_config",
           "token_logprobs"]
