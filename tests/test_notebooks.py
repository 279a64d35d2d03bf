"""The notebooks under notebooks/ run top to bottom on CPU (as a Colab user would run them)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart.ipynb", "objectives.ipynb", "your_task.ipynb"])
def test_notebook_executes(name):
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  # Run from the repository root so `experiments` imports like in the README's commands.
  NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
