"""branch_replay_jax: exact-gradient shared-prefix replay for RL post-training in JAX."""

import logging as _logging
import os as _os

__version__ = "0.1.0"

# XLA CPU backend options chosen by measurement (docs/design.md, "CPU backend options";
# benchmarks/backend.py): flag -> value, appended to XLA_FLAGS when this package is imported, for each
# flag the environment's XLA_FLAGS does not already name. To override one, name it in XLA_FLAGS
# (e.g. XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=individual_dot restores XLA's default).
# They take effect only if the package is imported before JAX starts its CPU backend (the first
# array or device query); the flags are CPU-only, ignored by GPU and TPU backends.
CPU_XLA_FLAGS: dict[str, str] = {}


def with_cpu_xla_flags(xla_flags: str) -> str:
  """`xla_flags` plus "--FLAG=VALUE" for each CPU_XLA_FLAGS entry whose flag it does not name."""
  named = {item.split("=", 1)[0].lstrip("-") for item in xla_flags.split()}
  extra = [f"--{flag}={value}" for flag, value in CPU_XLA_FLAGS.items() if flag not in named]
  return " ".join([xla_flags.strip(), *extra]).strip()


if CPU_XLA_FLAGS:
  _os.environ["XLA_FLAGS"] = with_cpu_xla_flags(_os.environ.get("XLA_FLAGS", ""))


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
