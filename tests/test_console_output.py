"""A quiet console: the package drops exactly two known noisy log records and nothing else."""


def test_importing_transformers_through_the_package_prints_no_pytorch_notice():
  # transformers (no torch installed) warns "PyTorch was not found. Models won't be available..."
  # on import; the package drops exactly that record at transformers' logger. A fresh interpreter,
  # since this one has imported transformers already.
  import subprocess
  import sys
  code = "import branch_replay_jax, transformers, logging; logging.getLogger('transformers').warning('still here')"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "PyTorch was not found" not in out.stderr + out.stdout
  assert "still here" in out.stderr   # the logger's other warnings still print


def test_orbax_wait_warning_is_dropped_at_the_absl_logger(caplog):
  import logging
  import branch_replay_jax  # noqa: F401  (installs the filters)
  with caplog.at_level(logging.WARNING, logger="absl"):
    logging.getLogger("absl").warning("Waiting for previous save to complete took %f seconds. If this ...", 5.0)
    logging.getLogger("absl").warning("another absl warning")
  assert [r.getMessage() for r in caplog.records] == ["another absl warning"]
