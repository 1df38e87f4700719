"""Every notebook in notebooks/ runs top to bottom, headless, in a kernel of this interpreter,
and each .ipynb holds the same cells as the jupytext source (.py, percent format) it is paired
with: an edit to one side alone, without `jupytext --sync`, fails here."""

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
jupytext = pytest.importorskip("jupytext")

FOLDER = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
PAIRING = "ipynb,py:percent"  # the .ipynb's jupytext metadata: `jupytext --sync` keeps both


def test_the_notebooks_are_there():
  assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb",
                                         "02_gradient_statistics_and_codec.ipynb"]
  assert sorted(p.stem for p in FOLDER.glob("*.py")) == [p.stem for p in NOTEBOOKS]


def _cells(notebook) -> list[tuple[str, str]]:
  return [(cell.cell_type, cell.source) for cell in notebook.cells]


def out_of_sync(source, notebook) -> list[str]:
  """How the jupytext `source` and the `notebook` it is paired with differ: cell by cell, the
  first line of each side; empty where they hold the same cells."""
  a, b = _cells(source), _cells(notebook)
  diffs = [f"cell {i}: {x[0]} {x[1].splitlines()[:1]} | {y[0]} {y[1].splitlines()[:1]}"
           for i, (x, y) in enumerate(zip(a, b)) if x != y]
  if len(a) != len(b):
    diffs.append(f"{len(a)} cells in the .py, {len(b)} in the .ipynb")
  return diffs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_ipynb_and_its_py_hold_the_same_cells(path: Path):
  notebook = jupytext.read(path)
  assert notebook.metadata.get("jupytext", {}).get("formats") == PAIRING
  source = jupytext.read(path.with_suffix(".py"))
  assert source.metadata.get("jupytext", {}).get("formats") == PAIRING
  differences = out_of_sync(source, notebook)
  assert not differences, (f"{path.name} and {path.stem}.py differ; edit the .py, then "
                           f"`jupytext --sync notebooks/{path.stem}.py`:\n" +
                           "\n".join(differences))


def test_an_edit_on_one_side_is_seen():
  source = jupytext.read(NOTEBOOKS[0].with_suffix(".py"))
  notebook = jupytext.read(NOTEBOOKS[0])
  assert not out_of_sync(source, notebook)
  code = next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code")
  notebook.cells[code].source += "\nprint('edited in Jupyter only')"
  assert out_of_sync(source, notebook) == [
      f"cell {code}: code {source.cells[code].source.splitlines()[:1]} | "
      f"code {notebook.cells[code].source.splitlines()[:1]}"]
  del notebook.cells[-1]
  assert out_of_sync(source, notebook)[-1] == (
      f"{len(source.cells)} cells in the .py, {len(source.cells) - 1} in the .ipynb")


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
