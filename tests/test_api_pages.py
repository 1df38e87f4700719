"""The API pages (docs/api/*.md) name every public name of `loco_jax` and of each layer, and
document every module of the layers with its members: a new public name or module without a
place on the pages fails here, before the site is built."""

import importlib
import pkgutil
import re
import types
from pathlib import Path

import loco_jax

PAGES = Path(__file__).resolve().parents[1] / "docs" / "api"
NOT_API = ("loco_jax.apps",)  # runs the library; not part of its API


def _public(module: types.ModuleType) -> list[str]:
  """`__all__` where the module has one; otherwise its submodules and the names it defines,
  less those that start with an underscore."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  names = {m.name for m in pkgutil.iter_modules(getattr(module, "__path__", []))}
  names |= {n for n, v in vars(module).items()
            if getattr(v, "__module__", None) == module.__name__}
  return sorted(n for n in names if not n.startswith("_"))


def _layers() -> list[types.ModuleType]:
  """loco_jax and its subpackages, but apps."""
  found = [loco_jax]
  for info in pkgutil.iter_modules(loco_jax.__path__, "loco_jax."):
    if info.ispkg and info.name not in NOT_API and not info.name.rpartition(".")[2].startswith("_"):
      found.append(importlib.import_module(info.name))
  return found


def _submodules(layer: types.ModuleType) -> list[str]:
  """Every module under the layer package `layer`, but private ones."""
  return [info.name for info in pkgutil.walk_packages(layer.__path__, layer.__name__ + ".")
          if not any(part.startswith("_") for part in info.name.split("."))]


def _read_pages(texts: list[str]) -> tuple[set[str], dict[str, set[str]]]:
  """The names in the pages' autosummary tables, each as written (leading ~ dropped) and
  prefixed with the module the page is in there (the last automodule or currentmodule above
  it), and each automodule's options (":members:", ...)."""
  entries, automodules = set(), {}
  for text in texts:
    for match in re.finditer(r"^\.\. automodule:: (\S+)\n((?:   :.*\n)*)", text, re.M):
      automodules[match.group(1)] = set(re.findall(r":([\w-]+):", match.group(2)))
    for match in re.finditer(r"^\.\. autosummary::\n((?:   .*\n|\n)*)", text, re.M):
      above = re.findall(r"^\.\. (?:automodule|currentmodule):: (\S+)", text[:match.start()],
                         re.M)
      for line in match.group(1).splitlines():
        line = line.strip().lstrip("~")
        if line and not line.startswith(":"):
          entries.add(line)
          if above:
            entries.add(f"{above[-1]}.{line}")
  return entries, automodules


def _resolve(dotted: str):
  """The object a dotted path names (a module, or an attribute of one); None if none."""
  module, _, attr = dotted.rpartition(".")
  try:
    return importlib.import_module(dotted)
  except ImportError:
    pass
  try:
    return getattr(importlib.import_module(module), attr) if module else None
  except (ImportError, AttributeError):
    return None


def missing_from_pages(texts: list[str]) -> list[str]:
  """What the pages `texts` leave out: a module of the layers without an automodule that has
  :members: and :undoc-members: (autodoc then documents every function and class the module
  defines, and its constants that have a `#:` doc comment), and a name of a layer's `__all__`
  in no autosummary table (an entry counts for a name when it names the same object under the
  same last component)."""
  entries, automodules = _read_pages(texts)
  listed = {(e.rpartition(".")[2], id(obj)) for e in entries
            if (obj := _resolve(e)) is not None}
  missing = []
  for layer in _layers():
    if layer.__name__ not in automodules:
      missing.append(f"module {layer.__name__}: no `.. automodule:: {layer.__name__}`")
    for name in _submodules(layer) if layer is not loco_jax else []:  # apps: not the API
      if not {"members", "undoc-members"} <= automodules.get(name, set()):
        missing.append(f"module {name}: no `.. automodule:: {name}` with :members: and "
                       f":undoc-members:")
    for name in _public(layer):
      if hasattr(layer, name):
        obj = getattr(layer, name)
      else:  # a submodule that nothing has imported yet
        obj = importlib.import_module(f"{layer.__name__}.{name}")
      if isinstance(obj, types.ModuleType) and not hasattr(layer, "__all__"):
        continue  # a submodule of a layer without __all__: its automodule is checked above
      if (name, id(obj)) not in listed:
        missing.append(f"{layer.__name__}.{name}: in no autosummary table")
  return missing


def _pages() -> list[str]:
  return [p.read_text() for p in sorted(PAGES.glob("*.md"))]


def test_every_public_name_is_on_the_api_pages():
  assert len(_pages()) >= 2
  assert not missing_from_pages(_pages())


def test_a_name_or_module_left_out_is_found():
  texts = _pages()
  without_loco = [t.replace("   ~transforms.loco.loco\n", "").replace("   ~loco.loco\n", "")
                  for t in texts]
  assert any(m.startswith("loco_jax.loco:") for m in missing_from_pages(without_loco))
  assert any(m.startswith("loco_jax.transforms.loco:") for m in missing_from_pages(without_loco))
  without_hlo = [t.replace(".. automodule:: loco_jax.comm.hlo\n", "") for t in texts]
  assert any(m.startswith("module loco_jax.comm.hlo:") for m in missing_from_pages(without_hlo))
  bare = [t.replace(".. automodule:: loco_jax.core.quant\n   :members:\n",
                    ".. automodule:: loco_jax.core.quant\n") for t in texts]
  assert any(m.startswith("module loco_jax.core.quant:") for m in missing_from_pages(bare))


def test_every_api_page_is_in_the_api_toctree():
  index = (PAGES / "index.md").read_text()
  toctree = re.search(r"```\{toctree\}\n((?:.*\n)*?)```", index).group(1)
  listed = {line.strip() for line in toctree.splitlines()
            if line.strip() and not line.startswith(":")}
  assert listed == {p.stem for p in PAGES.glob("*.md")} - {"index"}
