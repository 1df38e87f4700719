"""Every path, module and public name that README.md and the pages under docs/ mention exists.

What counts as a mention:
- a path: a link's target (relative to its page), or a token anywhere in the text whose first
  part is a top-level entry of the repository (`loco_jax/core/loco.py`, `docs/records/x.json`,
  `scripts/docs`), starts with ./ or ../, or names a Markdown file (`shared/DESIGN.md`). It
  must exist relative to the repository's root or to its page; a glob must match something,
  {a,b} is expanded. Placeholders (<...>, $VAR), absolute paths, URLs and what .gitignore
  ignores (outputs such as runs/) are not checked.
- a module or name under loco_jax written out (`loco_jax.train.parallel`, `loco_jax.loco`): it
  must import, then resolve attribute by attribute.
- inline code that is only a dotted name starting at a loco_jax module or public name
  (`parallel.make_train_step`, `kernels.compress_step(...)`, `Co3State.overflows`): it must
  resolve from one module of that short name, or, where the first part is only a module's
  short name, every attribute after it must be a name loco_jax defines (an object named like
  a module: `state.overflows`).
- inline code that is only a call (`loco(bits=4)`): the function must be a builtin, a name of
  numpy, jax, jax.numpy, jax.lax, optax or math, or a name some loco_jax module defines (its
  functions' arguments included: `loss_fn(p, batch)` is the user's own).
"""

import ast
import builtins
import fnmatch
import glob
import importlib
import itertools
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loco_jax

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loco_jax"


def _ignore_patterns() -> list[str]:
  path = ROOT / ".gitignore"
  lines = path.read_text().splitlines() if path.exists() else []
  return [line.strip().strip("/") for line in lines
          if line.strip() and not line.startswith(("#", "!"))]


IGNORED = _ignore_patterns() + [".git"]


def ignored(rel: str) -> bool:
  """Whether .gitignore keeps `rel` (a path relative to the root) out of the repository."""
  parts = rel.strip("/").split("/")
  prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
  return any(fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(part, pattern)
             for pattern in IGNORED for prefix, part in zip(prefixes, parts))


TOP = {p.name for p in ROOT.iterdir() if not ignored(p.name)}
PAGES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if not ignored(p.relative_to(ROOT).as_posix()))

# Short names: the last part of every loco_jax module ("parallel" -> loco_jax.train.parallel).
MODULES = sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".").removesuffix(
    ".__init__") for p in PACKAGE.rglob("*.py"))
SHORT: dict[str, list[str]] = {}
for _name in MODULES:
  SHORT.setdefault(_name.rpartition(".")[2], []).append(_name)


def _defined_names() -> set[str]:
  """Every function, class, argument and assignment some loco_jax module defines."""
  names = set()
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # the user's callables
        names.update(a.arg for a in node.args.args + node.args.kwonlyargs)  # (`loss_fn(p, b)`)
      elif isinstance(node, ast.Assign):
        names.update(t.id for t in node.targets if isinstance(t, ast.Name))
      elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        names.add(node.target.id)  # a NamedTuple's or dataclass's fields too
  return names


DEFINED = _defined_names() | set(SHORT)
OTHER_NAMESPACES = (builtins, np, jnp, jax, jax.lax, optax, math)

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
PATHLIKE = re.compile(r"(?<![\w./~$@:-])((?:\.\.?/)*[\w.][\w.\-]*(?:/[\w.\-*{},<>]*)+)")
DOTTED = re.compile(r"(?<![\w.])loco_jax(?:\.[A-Za-z_]\w*)+")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
WHOLE_DOTTED = re.compile(r"([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(\(.*\))?")
WHOLE_CALL = re.compile(r"([A-Za-z_]\w*)\(.*\)")


class Mention(NamedTuple):
  kind: str   # "path", "link", "name", "short", "call"
  text: str
  line: int


def _line(text: str, pos: int) -> int:
  return text.count("\n", 0, pos) + 1


def mentions(text: str) -> list[Mention]:
  """Every mention in a page's Markdown `text` that the checks below look at."""
  found = []
  for m in LINK.finditer(text):
    target = m.group(1)
    if not URL.match(target) and not target.startswith(("#", "mailto:")):
      found.append(Mention("link", target.split("#")[0], _line(text, m.start())))
  bare = URL.sub(lambda m: " " * len(m.group()), LINK.sub(lambda m: " " * len(m.group()), text))
  for m in PATHLIKE.finditer(bare):
    token = m.group(1).rstrip(".,")
    first = token.split("/")[0]
    if first in TOP or first in (".", "..") or token.endswith(".md"):
      found.append(Mention("path", token, _line(text, m.start())))
  for m in DOTTED.finditer(URL.sub(" ", text)):
    found.append(Mention("name", m.group(), _line(text, m.start())))
  prose = FENCE.sub(lambda m: "\n" * m.group().count("\n"), text)
  for m in INLINE.finditer(prose):
    span = m.group(1).strip()
    dotted, call = WHOLE_DOTTED.fullmatch(span), WHOLE_CALL.fullmatch(span)
    if dotted and dotted.group(1) != "loco_jax" and (dotted.group(1) in SHORT
                                                     or hasattr(loco_jax, dotted.group(1))):
      found.append(Mention("short", dotted.group(1) + dotted.group(2), _line(prose, m.start())))
    elif call and not dotted:
      found.append(Mention("call", call.group(1), _line(prose, m.start())))
  return found


def _expand_braces(path: str) -> list[str]:
  m = re.search(r"\{([^{}]*)\}", path)
  if not m:
    return [path]
  options = m.group(1).split(",")
  return list(itertools.chain.from_iterable(
      _expand_braces(path[:m.start()] + option + path[m.end():]) for option in options))


def _path_problem(path: str, page: Path) -> str | None:
  if not path or any(c in path for c in "<>$") or path.startswith(("/", "~")):
    return None
  for each in _expand_braces(path):
    if glob.glob(os.path.normpath(page.parent / each)) or glob.glob(str(ROOT / each)):
      continue
    rel = os.path.relpath(page.parent / each, ROOT)
    if ignored(each) or (not rel.startswith("..") and ignored(Path(rel).as_posix())):
      continue  # an output (runs/, a build folder): not in the repository by design
    return ("no such file or folder from the repository's root or from "
            f"{page.parent.relative_to(ROOT).as_posix()}/")
  return None


def resolve(dotted: str) -> str | None:
  """None if `dotted` (loco_jax.x.y...) imports and resolves, else why not."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    module_name = ".".join(parts[:i])
    try:
      obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
        continue  # not a module: an attribute of a shorter one, tried next
      return f"{module_name} does not import: {e}"
    for j, attr in enumerate(parts[i:], start=i):
      if not hasattr(obj, attr):
        return f"{'.'.join(parts[:j])} has no attribute {attr!r}"
      obj = getattr(obj, attr)
    return None
  return f"no module {parts[0]}"


def problem(mention: Mention, page: Path) -> str | None:
  """Why `mention` on `page` names nothing, or None where it exists."""
  if mention.kind in ("path", "link"):
    return _path_problem(mention.text, page)
  if mention.kind == "name":
    return resolve(mention.text)
  if mention.kind == "short":
    first, _, rest = mention.text.partition(".")
    candidates = list(SHORT.get(first, [])) + (["loco_jax." + first]
                                               if hasattr(loco_jax, first) else [])
    whys = [resolve(f"{c}.{rest}") for c in candidates]
    if None in whys or (first not in dir(loco_jax) and set(rest.split(".")) <= DEFINED):
      return None  # resolves; or an object named like a module (`state.overflows`) whose
    return "; ".join(whys)  # attributes loco_jax defines
  if any(hasattr(ns, mention.text) for ns in OTHER_NAMESPACES) or mention.text in DEFINED:
    return None
  return f"{mention.text}(...) is not a name of loco_jax, the builtins, numpy, jax or optax"


def problems(text: str, page: Path) -> list[str]:
  """'line: `mention`: why' for every mention in `text` (as if on `page`) that names nothing."""
  out = []
  for mention in mentions(text):
    why = problem(mention, page)
    if why:
      out.append(f"{mention.line}: `{mention.text}` ({mention.kind}): {why}")
  return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_mention_on_a_page_exists(page):
  found = problems(page.read_text(), page)
  assert not found, f"{page.relative_to(ROOT)} mentions what does not exist:\n" + "\n".join(found)


def test_pages_are_found():
  names = {p.relative_to(ROOT).as_posix() for p in PAGES}
  assert "README.md" in names and len(names) > 1, names


PAGE = ROOT / "docs" / "results" / "example.md"  # where the texts below pretend to sit


def test_existing_mentions_pass():
  text = """
See `loco_jax/core/quant.py`, loco_jax/comm/wire.py:27 and tests/test_loco.py::test_x, the
`loco_jax.train.parallel` module, `loco_jax.loco`, `parallel.make_train_step`,
`kernels.compress_step(skip=...)`, `Co3State.overflows`, `state.overflows`, `loco(bits=4)`,
`jnp.sum(x)`,
`max(a, b)`, [the tests](../../tests/test_loco.py), loco_jax/{core,comm}/__init__.py,
`tests/test_*.py`, [the web](https://example.com/x/y.md), runs/long/<method>/config.json,
/tmp/bench.json, runs/demo/results.json and docs/records/.

```
python experiments/long_run.py run --out runs/long
from loco_jax.train import parallel
```
"""
  assert problems(text, PAGE) == []
  kinds = {m.kind for m in mentions(text)}
  assert kinds == {"path", "link", "name", "short", "call"}, kinds


@pytest.mark.parametrize("text, reported", [
    ("the code is in `loco_jax/core/nothere.py`", "loco_jax/core/nothere.py"),
    ("records: docs/records/made_up.json.", "docs/records/made_up.json"),
    ("run `python experiments/not_an_experiment.py --fast`", "experiments/not_an_experiment.py"),
    ("read nowhere/DESIGN.md first", "nowhere/DESIGN.md"),
    ("see [the guide](../guides/no_such_guide.md#intro)", "../guides/no_such_guide.md"),
    ("every `tests/test_no_such_thing_*.py`", "tests/test_no_such_thing_*.py"),
    ("`loco_jax.train.not_a_module`", "loco_jax.train.not_a_module"),
    ("the transformation loco_jax.locoo", "loco_jax.locoo"),
    ("`loco_jax.loco.not_an_attribute`", "loco_jax.loco.not_an_attribute"),
    ("`parallel.make_train_stepp`", "parallel.make_train_stepp"),
    ("call `locoo(bits=4)`", "locoo"),
    ("```\nfrom loco_jax.nowhere import x\n```", "loco_jax.nowhere"),
])
def test_a_made_up_mention_is_reported(text, reported):
  found = problems(text, PAGE)
  assert len(found) == 1 and f"`{reported}`" in found[0], found
