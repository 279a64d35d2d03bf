"""branch_replay_jax: exact-gradient shared-prefix replay for RL post-training in JAX."""

import logging as _logging

__version__ = "0.1.0"


class _DropMessages(_logging.Filter):
  """Drops records whose message starts with one of `prefixes`; every other record passes."""

  def __init__(self, *prefixes: str):
    super().__init__()
    self.prefixes = prefixes

  def filter(self, record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith(self.prefixes)


# Other libraries' messages that say nothing to a user of this package, silenced at their source
# logger (installed before transformers or orbax is imported; a filter survives transformers
# configuring its logger, a level would not):
# - transformers warns "PyTorch was not found. Models won't be available ..." on import: we use
#   only its tokenizers.
# - orbax warns "Waiting for previous save to complete took N seconds ..." (via absl): our saves
#   are asynchronous (outputs/checkpoints.py) and the step times they block for are ours to report.
_logging.getLogger("transformers").addFilter(_DropMessages("PyTorch was not found"))
_logging.getLogger("absl").addFilter(_DropMessages("Waiting for previous save to complete"))
