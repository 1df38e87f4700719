"""Sphinx configuration of the loco-jax site: MyST pages, the notebooks, API pages from the
docstrings. Build it with `sh scripts/docs` (warnings are errors). Needs no network."""

import os
import shutil
import sys
import tomllib
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the loco_jax of this tree, installed or not
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # autodoc imports loco_jax; no accelerator needed

project = "loco-jax"
author = "the loco-jax authors"
copyright = "the loco-jax authors"  # noqa: A001 (Sphinx's name)
release = version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

extensions = [
    "myst_nb",  # MyST Markdown pages and .ipynb notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # the docstrings' Args:/Returns:/Example: sections
    "sphinx.ext.viewcode",
]

# docs/'s root holds conf.py and index.md; the records and any page not yet moved out of the
# root are not pages of the site.
exclude_patterns = ["_build", "records", "**/.ipynb_checkpoints"]

# MyST: `#anchor` links to headings down to ###; ::: fences; $math$.
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# The notebooks are stored without outputs: the build runs each (a failing cell fails it), so
# that the site shows what they print and plot.
nb_execution_mode = "auto"
nb_execution_timeout = 600
nb_execution_raise_on_error = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autosummary_generate = False  # the API pages are written by hand; tests/test_api_pages.py
                              # checks that they name every public name
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "code"  # `x` in a docstring is code, as in Markdown

html_theme = "furo"
html_title = "loco-jax"


def _copy_notebooks() -> None:
  """notebooks/*.ipynb into docs/notebooks/ (git ignores it), where Sphinx finds them; a copy
  is replaced only when it differs, so that an unchanged notebook is not read again."""
  target = DOCS / "notebooks"
  target.mkdir(exist_ok=True)
  sources = {p.name: p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
  for old in target.glob("*.ipynb"):
    if old.name not in sources:
      old.unlink()
  for name, source in sources.items():
    copy = target / name
    if not copy.exists() or copy.read_bytes() != source.read_bytes():
      shutil.copyfile(source, copy)


_copy_notebooks()
