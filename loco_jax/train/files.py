"""Result files written whole or not at all: checked writable before the work, then a temp file
(or folder) beside the target and a rename; digests of a folder's files, to tell a complete
folder from a damaged one; and JSON read from files that may come from anywhere."""

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np

MAX_JSON_DEPTH = 64


def check_writable(path: str | os.PathLike, option: str) -> None:
  """ValueError unless a file can be created at `path` (its folder exists and takes a new file,
  and `path` is not a folder): tried with a temp file beside it, removed at once."""
  target = Path(path)
  if not path or target.is_dir():
    raise ValueError(f"{option} must name a file, got {path!r}")
  folder = target.parent
  if not folder.is_dir():
    raise ValueError(f"{option} {path!r}: the folder {str(folder)!r} does not exist")
  try:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}.", suffix=".probe"):
      pass
  except OSError as e:
    raise ValueError(f"{option} {path!r} cannot be written: {e.strerror or e}") from None


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

  Readers see the previous set of files or the new one, never a mix: a full `target` is first
  renamed aside (`.NAME.old-XXXX`, where a hard kill leaves it whole) and removed once the new
  set is in place, with Ctrl-C held back in between.

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


# A JSON string up to its closing quote, or to the end of the text if it has none: every quote
# starts a match, so the scan stays linear on hostile input.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.DOTALL)


def json_depth(data: bytes) -> int:
  """How deep the arrays and objects of the JSON text `data` nest (strings skipped as JSON reads
  them), counted in linear time and without recursion, whatever `data` holds.

  Example:
    >>> json_depth(b'{"a": [1, "]]"], "b": {}}')
    2
  """
  codes = np.frombuffer(_JSON_STRING.sub(b"", data), np.uint8)
  opens = (codes == ord("[")) | (codes == ord("{"))
  closes = (codes == ord("]")) | (codes == ord("}"))
  return int(np.cumsum(opens.astype(np.int32) - closes).max(initial=0))


def read_json(path: str | os.PathLike, what: str, max_bytes: int,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
  """The JSON document in `path`, a file that is not trusted; `what` names it in errors.

  A file that is missing, not a regular file, larger than `max_bytes`, nested deeper than
  `max_depth` or not UTF-8 JSON is a ValueError; at most `max_bytes` + 1 bytes are read.

  Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "deep.json"
    >>> _ = path.write_text("[" * 100000)
    >>> read_json(path, "record", 1 << 20)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../deep.json: the record nests deeper than 64 levels
  """
  path = Path(path)
  try:
    mode = path.lstat().st_mode
  except FileNotFoundError:
    raise ValueError(f"{path} is missing: there is no {what}") from None
  except OSError as e:
    raise ValueError(f"{path}: the {what} cannot be read ({e})") from None
  if not stat.S_ISREG(mode):
    raise ValueError(f"{path}: the {what} is not a regular file (a folder, a symbolic link or "
                     f"a device)")
  try:
    with open(path, "rb") as f:
      data = f.read(max_bytes + 1)
  except OSError as e:
    raise ValueError(f"{path}: the {what} cannot be read ({e})") from None
  if len(data) > max_bytes:
    raise ValueError(f"{path}: the {what} is larger than {max_bytes} bytes")
  if json_depth(data) > max_depth:
    raise ValueError(f"{path}: the {what} nests deeper than {max_depth} levels")
  try:
    return json.loads(data)
  except ValueError as e:  # bytes that are not UTF-8 JSON
    raise ValueError(f"{path}: the {what} is not JSON ({e})") from None


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


def _is_plain_relative(relative: Any) -> bool:
  """A relative POSIX path that names something inside its folder: no '..', '.', empty part,
  leading '/', backslash or NUL."""
  if not isinstance(relative, str) or "\\" in relative or "\0" in relative:
    return False
  return all(part not in ("", ".", "..") for part in relative.split("/"))


def _regular_files(folder: Path) -> dict[str, os.stat_result]:
  """{relative path: stat} of every file under `folder`; a ValueError for a symbolic link (file
  or folder, followed by nothing here) or anything else that is not a regular file or folder."""
  def unreadable(error: OSError):
    raise ValueError(f"{error.filename}: cannot be listed ({error.strerror})")
  found = {}
  for root, folders, names in os.walk(folder, onerror=unreadable):
    for name in folders + names:
      path = Path(root, name)
      info = path.lstat()
      if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{path} is a symbolic link: the folder holds regular files and "
                         f"folders only, and nothing read from it may lead outside it")
      if name in names:
        if not stat.S_ISREG(info.st_mode):
          raise ValueError(f"{path} is not a regular file (a device, socket or pipe)")
        found[path.relative_to(folder).as_posix()] = info
  return found


def check_digests(folder: str | os.PathLike, expected: dict[str, list],
                  exclude: tuple[str, ...] = ()) -> None:
  """Raises a ValueError naming the first file under `folder` that differs from `expected`
  (`digests` as written): missing, not a file, another size or bytes, or a stray file.

  `expected` is not trusted: a path in it outside `folder` is an error, as is a symbolic link
  under `folder`; only regular files inside it are read.

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
  outside = [relative for relative in expected if not _is_plain_relative(relative)]
  if outside:
    raise ValueError(f"{folder}: the listed path {outside[0]!r} is not a plain relative path "
                     f"inside it (no '..', '.', empty parts, leading '/' or backslashes)")
  found = _regular_files(folder)
  for relative, (size, sha256) in expected.items():
    path = folder / relative
    if relative not in found:
      raise ValueError(f"{path} is not a file" if path.exists() else f"{path} is missing")
    if found[relative].st_size != size:
      raise ValueError(f"{path} has {found[relative].st_size} bytes; {size} were written "
                       f"(truncated or overwritten)")
    if _sha256(path) != sha256:
      raise ValueError(f"{path}: its bytes differ from those written (sha256 {sha256})")
  for relative in found:
    if relative not in expected and relative not in exclude:
      raise ValueError(f"{folder / relative} was not written with the others (a stray file)")
