"""Offline datasets: byte corpora (stdlib source, local text), LM batches, CIFAR-10 binaries."""
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
# Skipped by `stdlib_corpus`: third-party code and test suites, which some distributions
# ship separately, so the corpus is the same on every install of one Python version.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                               "idle_test"})
CIFAR10_RECORD_BYTES = 1 + 32 * 32 * 3
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILES = ("test_batch.bin",)


def _sorted_files(root: Path, suffixes: tuple[str, ...], skip_dirs: frozenset[str]) -> list[Path]:
  """Files under root whose suffix (lower-cased) is in suffixes, sorted by relative path."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
    for name in filenames:
      if not name.startswith(".") and os.path.splitext(name)[1].lower() in suffixes:
        found.append(Path(dirpath) / name)
  return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _concat(files: list[Path], max_bytes: int | None) -> bytes:
  chunks, total = [], 0
  for path in files:
    if max_bytes is not None and total >= max_bytes:
      break
    data = path.read_bytes()
    if max_bytes is not None:
      data = data[:max_bytes - total]
    chunks.append(data)
    total += len(data)
  return b"".join(chunks)


def stdlib_corpus(max_bytes: int = 4_000_000) -> bytes:
  """The Python standard library's .py sources, concatenated in sorted path order.

  Deterministic for a given Python version; skips site-packages and test suites. The last
  file is cut so the result has at most `max_bytes` bytes.

  Example:
    >>> len(stdlib_corpus(1000))
    1000
  """
  if not isinstance(max_bytes, int) or max_bytes < 1:
    raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}.")
  root = Path(sysconfig.get_paths()["stdlib"])
  corpus = _concat(_sorted_files(root, (".py",), _STDLIB_SKIP_DIRS), max_bytes)
  if not corpus:
    raise ValueError(f"no .py files found under the standard library folder {root}.")
  return corpus


def text_corpus(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
  """The bytes of a text file, or of every text file under a folder (recursive, sorted).

  A file is read whatever its suffix. In a folder, files ending in .txt, .md, .py or .rst
  (any case) count; hidden files and folders (name starting with ".") are skipped.

  Example:
    >>> corpus = text_corpus("docs/")  # doctest: +SKIP
  """
  root = Path(path)
  accepted = "a non-empty text file or a folder holding non-empty " + "/".join(TEXT_SUFFIXES) + \
      " files"
  if root.is_file():
    corpus = _concat([root], max_bytes)
    if not corpus:
      raise ValueError(f"text corpus file {root} is empty; expected {accepted}.")
    return corpus
  if root.is_dir():
    files = _sorted_files(root, TEXT_SUFFIXES, frozenset())
    if not files:
      raise ValueError(f"text corpus folder {root} holds no text files; expected {accepted}.")
    corpus = _concat(files, max_bytes)
    if not corpus:
      raise ValueError(f"text corpus folder {root} holds only empty text files; "
                       f"expected {accepted}.")
    return corpus
  raise ValueError(f"text corpus path {root} does not exist; expected {accepted}.")


def split(corpus: bytes, eval_fraction: float = 0.1) -> tuple[bytes, bytes]:
  """Splits a corpus into (train, eval): eval is the last `eval_fraction` of the bytes.

  Example:
    >>> split(b"0123456789", 0.2)
    (b'01234567', b'89')
  """
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}.")
  n_eval = int(round(len(corpus) * eval_fraction))
  if n_eval < 1 or n_eval >= len(corpus):
    raise ValueError(f"a corpus of {len(corpus)} bytes with eval_fraction={eval_fraction} "
                     f"leaves an empty train or eval part; use a longer corpus.")
  return corpus[:-n_eval], corpus[-n_eval:]


def _as_tokens(data: bytes, seq_len: int, batch_size: int) -> np.ndarray:
  for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if len(data) < seq_len + 1:
    raise ValueError(f"data of {len(data)} bytes is shorter than one window of "
                     f"seq_len + 1 = {seq_len + 1} bytes.")
  return np.frombuffer(data, dtype=np.uint8)


def batches(data: bytes, batch_size: int, seq_len: int, seed: int = 0,
            num_batches: int | None = None) -> Iterator[np.ndarray]:
  """Random windows of the data: int32 [batch_size, seq_len + 1] numpy arrays.

  Window starts are uniform over every offset and depend only on (len(data), batch_size,
  seq_len, seed), so every method sees the same data order for one seed. Endless unless
  `num_batches` is given.

  Example:
    >>> next(batches(b"hello world" * 10, batch_size=4, seq_len=8)).shape
    (4, 9)
  """
  tokens_N = _as_tokens(data, seq_len, batch_size)
  rng = np.random.default_rng(seed)
  offsets_W = np.arange(seq_len + 1)
  count = 0
  while num_batches is None or count < num_batches:
    starts_B = rng.integers(0, len(tokens_N) - seq_len, size=batch_size)
    yield tokens_N[starts_B[:, None] + offsets_W].astype(np.int32)
    count += 1


def eval_batches(data: bytes, batch_size: int, seq_len: int,
                 max_batches: int | None = None) -> Iterator[np.ndarray]:
  """Fixed windows for evaluation: int32 [batch_size, seq_len + 1] numpy arrays.

  Window i starts at i * seq_len, so consecutive windows share one byte and every byte
  after the first is a target exactly once. A last incomplete batch is dropped (fixed shapes
  for jit); at most `max_batches` batches.

  Example:
    >>> [b.shape for b in eval_batches(bytes(100), batch_size=2, seq_len=9)]
    [(2, 10), (2, 10), (2, 10), (2, 10), (2, 10)]
  """
  tokens_N = _as_tokens(data, seq_len, batch_size)
  n_windows = (len(tokens_N) - 1) // seq_len
  n_batches = n_windows // batch_size
  if n_batches == 0:
    raise ValueError(f"data of {len(data)} bytes gives {n_windows} windows of seq_len + 1 = "
                     f"{seq_len + 1} bytes, fewer than batch_size={batch_size}.")
  if max_batches is not None:
    n_batches = min(n_batches, max_batches)
  offsets_W = np.arange(seq_len + 1)
  for b in range(n_batches):
    starts_B = (b * batch_size + np.arange(batch_size)) * seq_len
    yield tokens_N[starts_B[:, None] + offsets_W].astype(np.int32)


def _read_cifar10_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
  raw = np.fromfile(path, dtype=np.uint8)
  if raw.size == 0 or raw.size % CIFAR10_RECORD_BYTES:
    raise ValueError(f"CIFAR-10 file {path} has {raw.size} bytes, not a positive multiple of "
                     f"the record size {CIFAR10_RECORD_BYTES} (1 label byte + 3072 pixels).")
  records_NxR = raw.reshape(-1, CIFAR10_RECORD_BYTES)
  labels_N = records_NxR[:, 0].astype(np.int32)
  bad = np.flatnonzero(labels_N > 9)
  if bad.size:
    raise ValueError(f"CIFAR-10 file {path}: record {bad[0]} has label {labels_N[bad[0]]}; "
                     f"accepted labels are 0..9.")
  images_NxHxWxC = records_NxR[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return np.ascontiguousarray(images_NxHxWxC), labels_N


def load_cifar10(path: str | os.PathLike, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
  """Reads CIFAR-10 binary batches: (images uint8 [N, 32, 32, 3], labels int32 [N]).

  `path` is one batch file (data_batch_*.bin, test_batch.bin) or a folder holding them, such
  as cifar-10-batches-bin/; for a folder, `split="train"` reads data_batch_1..5.bin (those
  present, in order) and `split="test"` reads test_batch.bin. Never downloads.

  Example:
    >>> images, labels = load_cifar10("cifar-10-batches-bin", split="test")  # doctest: +SKIP
  """
  root = Path(path)
  if root.is_file():
    return _read_cifar10_file(root)
  if not root.is_dir():
    raise ValueError(f"CIFAR-10 path {root} does not exist; expected a binary batch file or a "
                     f"folder such as cifar-10-batches-bin/ (no download is attempted).")
  names = {"train": CIFAR10_TRAIN_FILES, "test": CIFAR10_TEST_FILES}.get(split)
  if names is None:
    raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
  files = [root / name for name in names if (root / name).is_file()]
  if not files:
    raise ValueError(f"CIFAR-10 folder {root} holds none of {', '.join(names)} "
                     f"(split={split!r}).")
  images, labels = zip(*(_read_cifar10_file(f) for f in files))
  return np.concatenate(images), np.concatenate(labels)
