"""Result files written whole or not at all: a temp file (or folder) beside the target, then a
rename; and digests of a folder's files, to tell a complete folder from a damaged one."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes `data` to `path` so that readers see the old file or the new one, never half.

  A temp file in the same folder is written, flushed to disk and renamed over `path` with the
  permissions of a normally created file; on any error it is removed and `path` is untouched.
  Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "table.md"
    >>> write_atomic(path, "| a |\\n")
    >>> path.read_text()
    '| a |\\n'
  """
  path = Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
  """`obj` as JSON through `write_atomic` (serialized first: a bad object writes nothing)."""
  write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def save_figure_atomic(fig: Any, path: str | os.PathLike) -> None:
  """A matplotlib figure as PNG through `write_atomic`."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png")
  write_atomic(path, buffer.getvalue())


# --- A set of files replaced as one ---------------------------------------------------------------

@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
  """Holds back SIGINT (Ctrl-C) until the block ends, so that it cannot fall between renames."""
  if threading.current_thread() is not threading.main_thread():
    yield  # Python runs signal handlers in the main thread only: nothing to hold back here
    return
  received = []
  previous = signal.signal(signal.SIGINT, lambda *args: received.append(args))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)
    if received:
      signal.raise_signal(signal.SIGINT)  # now handled as it would have been


def staging_folder(target: str | os.PathLike) -> Path:
  """A new empty folder beside `target` (`.NAME.new-XXXX`) to write a set of files into."""
  target = Path(target)
  return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.new-"))


def replace_folder(staging: str | os.PathLike, target: str | os.PathLike) -> None:
  """Puts the folder `staging` in the place of `target` (absent, or a folder); both must have
  the same parent folder.

  Readers see the previous set of files or the new one, never a mix: a missing or empty
  `target` is replaced by one rename; a full one is first renamed aside (`.NAME.old-XXXX`),
  then removed once the new set is in place, with Ctrl-C held back from the first rename to
  the removal (a hard kill between the renames leaves the previous set whole in
  `.NAME.old-XXXX`).
  Example:
    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "out"
    >>> staging = staging_folder(target)
    >>> (staging / "results.json").write_text("[]")
    2
    >>> replace_folder(staging, target)
    >>> sorted(p.name for p in target.iterdir()), staging.exists()
    (['results.json'], False)
  """
  staging, target = Path(staging), Path(target)
  if staging.absolute().parent != target.absolute().parent:
    raise ValueError(f"{staging} and {target} must be in the same folder (one rename each)")
  if not target.exists() or (target.is_dir() and not any(target.iterdir())):
    os.replace(staging, target)  # rename() takes the place of a missing or empty folder
    return
  aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
  try:
    with _sigint_deferred():
      os.replace(target, aside)  # `aside` is an empty folder: rename() may replace it
      try:
        os.rename(staging, target)
      except BaseException:
        os.replace(aside, target)
        raise
      shutil.rmtree(aside)  # before a held-back Ctrl-C, so that no old set is left over
  except BaseException:
    with contextlib.suppress(OSError):
      aside.rmdir()  # still empty if the set never moved; gone if it moved back
    raise


# --- Digests --------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def digests(folder: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict[str, list]:
  """{relative path: [size in bytes, sha256 hex]} of every file under `folder`, sorted.

  `exclude`: relative paths left out (e.g. the file the digests are stored in).
  Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.txt").write_text("abc")
    >>> digests(folder)["a.txt"][0]
    3
  """
  folder = Path(folder)
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = Path(root, name)
      relative = path.relative_to(folder).as_posix()
      if relative not in exclude:
        out[relative] = [path.stat().st_size, _sha256(path)]
  return dict(sorted(out.items()))


def check_digests(folder: str | os.PathLike, expected: dict[str, list],
                  exclude: tuple[str, ...] = ()) -> None:
  """Raises a ValueError naming the first file under `folder` that differs from `expected`
  (`digests` of the folder as it was written): missing, not a file, another size, other
  bytes, or a file that was not there.
  Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.txt").write_text("abc")
    >>> expected = digests(folder)
    >>> _ = (folder / "a.txt").write_text("abd")
    >>> check_digests(folder, expected)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../a.txt: its bytes differ from those written (sha256 ...)
  """
  folder = Path(folder)
  for relative, (size, sha256) in expected.items():
    path = folder / relative
    if not path.exists():
      raise ValueError(f"{path} is missing")
    if not path.is_file():
      raise ValueError(f"{path} is not a file")
    if path.stat().st_size != size:
      raise ValueError(f"{path} has {path.stat().st_size} bytes; {size} were written "
                       f"(truncated or overwritten)")
    if _sha256(path) != sha256:
      raise ValueError(f"{path}: its bytes differ from those written (sha256 {sha256})")
  for root, _, names in os.walk(folder):
    for name in names:
      path = Path(root, name)
      relative = path.relative_to(folder).as_posix()
      if relative not in expected and relative not in exclude:
        raise ValueError(f"{path} was not written with the others (a stray file)")
