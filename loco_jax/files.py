"""Result files written whole or not at all: a temp file beside the target, then a rename."""

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes `data` to `path` so that readers see the old file or the new one, never half.

  A temp file in the same folder is written, flushed to disk and renamed over `path` with the
  permissions of a normally created file; on any error it is removed and `path` is untouched.
  Example:
    >>> write_atomic("runs/x/table.md", "| a |\\n")
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
