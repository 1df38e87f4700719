"""Every notebook in notebooks/ runs top to bottom, headless, in a kernel of this interpreter."""

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

FOLDER = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))


def test_the_notebooks_are_there():
  assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb",
                                         "02_gradient_statistics_and_codec.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, monkeypatch):
  # jupyter_client starts a "python3" kernelspec whose command is `python` with sys.executable
  # (here: the venv's); PATH puts the same interpreter first for anything else the kernel runs.
  monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep +
                     os.environ.get("PATH", ""))
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(FOLDER)}})
  client.execute()
  errors = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
  code = [c for c in notebook.cells if c.cell_type == "code"]
  assert all(c.get("execution_count") for c in code)  # every cell ran
  assert any(o.get("output_type") == "display_data" for c in code for o in c.get("outputs", []))
