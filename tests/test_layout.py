"""The package layout: the library never imports the applications, layers only point down, no
import cycle, small modules and functions, no private name crosses a module, one public face."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import loco_jax

ROOT = Path(loco_jax.__file__).parent
LIBRARY = [m.name for m in pkgutil.walk_packages(loco_jax.__path__, "loco_jax.")
           if not m.name.startswith("loco_jax.apps") and m.name != "loco_jax.__main__"]
LAYERS = ("core", "kernels", "comm", "codecs", "transforms", "train")  # each imports only down
# codecs sit beside kernels: both only use core.
BELOW = {"core": set(), "kernels": {"core"}, "codecs": {"core"}, "comm": {"core", "kernels"},
         "transforms": {"core", "kernels", "comm", "codecs"},
         "train": {"core", "kernels", "comm", "codecs", "transforms"}}


def _source(name: str) -> tuple[Path, ast.Module]:
  path = Path(importlib.import_module(name).__file__)
  return path, ast.parse(path.read_text())


def _imports(name: str) -> list[tuple[str, str | None, int]]:
  """(module imported, name taken from it or None, line) for every import in `name`, those
  inside functions too; relative imports resolved."""
  path, tree = _source(name)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out += [(a.name, None, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        out.append((full if full in LIBRARY else base, a.name, node.lineno))
  return out


def _module_of(target: str) -> str | None:
  while target and target not in LIBRARY:
    target = target.rpartition(".")[0]
  return target or None


def _layer(name: str) -> str | None:
  parts = name.split(".")
  return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


@pytest.mark.slow
def test_the_library_never_imports_the_applications():
  # In a fresh interpreter: every library module imported, and nothing of loco_jax.apps.
  code = ("import sys, importlib\n"
          f"for name in {LIBRARY!r}: importlib.import_module(name)\n"
          "print(sorted(m for m in sys.modules if m.startswith('loco_jax.apps')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
                       cwd=Path(__file__).resolve().parents[1])
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]"


def test_layers_only_point_down_and_no_private_name_crosses_a_module():
  wrong, private = [], []
  for name in LIBRARY:
    for target, taken, line in _imports(name):
      module = _module_of(target)
      if module is None or module == name:
        continue
      here, there = _layer(name), _layer(module)
      if here and there and there != here and there not in BELOW[here]:
        wrong.append(f"{name}:{line} imports {module}")
      if taken and taken.startswith("_") and not taken.startswith("__"):
        private.append(f"{name}:{line} imports {taken} from {module}")
  assert not wrong, wrong
  assert not private, private


def _module_names(name: str) -> set[str]:
  """The names by which module `name` refers to other library modules it imports."""
  bound = set()
  for node in ast.walk(_source(name)[1]):
    if isinstance(node, ast.ImportFrom) or isinstance(node, ast.Import):
      for a in node.names:
        full = a.name if isinstance(node, ast.Import) else f"{node.module}.{a.name}"
        if isinstance(node, ast.ImportFrom) and node.level:
          full = f"{name.rpartition('.')[0]}.{node.module + '.' if node.module else ''}{a.name}"
        if full in LIBRARY or full == "loco_jax":
          bound.add(a.asname or a.name.split(".")[0])
  return bound


def test_no_private_name_is_read_from_another_module():
  # `module._name` crosses a module as surely as `from module import _name`.
  reads = []
  for name in LIBRARY:
    modules = _module_names(name)
    for node in ast.walk(_source(name)[1]):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in modules and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        reads.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
  assert not reads, reads


def test_the_private_read_check_sees_a_private_read(tmp_path, monkeypatch):
  (tmp_path / "reader.py").write_text("from loco_jax.core import quant\n\n\ndef f():\n  return quant._private\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(sys.modules[__name__], "LIBRARY", LIBRARY + ["reader"])
  assert _module_names("reader") == {"quant"}
  with pytest.raises(AssertionError, match=r"reader:5 reads quant._private"):
    test_no_private_name_is_read_from_another_module()


def test_no_import_cycle():
  edges = {name: set() for name in LIBRARY}
  for name in LIBRARY:
    own_package = name if _source(name)[0].name == "__init__.py" else None
    for target, _, _ in _imports(name):
      module = _module_of(target)
      # A package's __init__ re-exporting its own children is not a cycle.
      if module and module != name and not (own_package and module.startswith(name + ".")):
        edges[name].add(module)
  seen, on_path = set(), []

  def visit(node):
    if node in on_path:
      return on_path[on_path.index(node):] + [node]
    if node in seen:
      return None
    seen.add(node)
    on_path.append(node)
    for nxt in sorted(edges[node]):
      cycle = visit(nxt)
      if cycle:
        return cycle
    on_path.pop()
    return None
  for name in LIBRARY:
    cycle = visit(name)
    assert cycle is None, " -> ".join(cycle)


def test_modules_and_functions_stay_small():
  big, long = {}, []
  for name in LIBRARY:
    path, tree = _source(name)
    lines = len(path.read_text().splitlines())
    if lines > 400:
      big[name] = lines
    long += [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
             for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             and node.end_lineno - node.lineno + 1 > 80]
  assert not big, big
  assert not long, long


def test_one_public_face_and_no_import_hook():
  assert not any(type(f).__module__.startswith("loco_jax") for f in sys.meta_path)
  for package in ("loco_jax", "loco_jax.transforms", "loco_jax.comm", "loco_jax.kernels"):
    module = importlib.import_module(package)
    for public in module.__all__:
      assert getattr(module, public) is not None, (package, public)
  assert loco_jax.loco.__module__ == "loco_jax.transforms.loco"  # the function, not a module


@pytest.mark.parametrize("old", ["parallel", "fsdp", "checkpoint", "huffman", "hierarchical"])
def test_old_module_paths_are_gone(old):
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module(f"loco_jax.{old}")


def _loco_imports(path: Path) -> list[tuple[str, str | None, int]]:
  """(module, name or None, line) for every absolute loco_jax import in the file at `path`."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("loco_jax")]
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loco_jax"):
      out += [(node.module, a.name, node.lineno) for a in node.names]
  return out


def _missing_imports(paths) -> list[str]:
  missing = []
  for path in paths:
    for module, name, line in _loco_imports(path):
      try:
        found = importlib.import_module(module)
        if name is not None and not hasattr(found, name):
          importlib.import_module(f"{module}.{name}")
      except ImportError:
        missing.append(f"{path.name}:{line} {module} {name or ''}")
  return missing


def test_every_name_the_experiments_and_tests_import_exists():
  # Experiments run by hand, not in the suite: a moved name would break them unseen.
  project = ROOT.parent
  paths = [p for folder in ("experiments", "tests", "notebooks", "loco_jax/apps")
           for p in sorted((project / folder).rglob("*.py"))]
  assert len(paths) > 50
  assert not _missing_imports(paths)


def test_the_import_check_sees_a_missing_name(tmp_path):
  stale = tmp_path / "stale.py"
  stale.write_text("from loco_jax.transforms.co3 import FORMATS\nimport loco_jax.gone\n")
  assert len(_missing_imports([stale])) == 2
