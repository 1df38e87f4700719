"""Tests for loco_jax.apps.data: byte corpora, LM batches and the CIFAR-10 binary reader."""
import itertools
from pathlib import Path

import numpy as np
import pytest

from loco_jax.apps import data


def test_stdlib_corpus_is_deterministic_python_source():
  corpus = data.stdlib_corpus(200_000)
  assert len(corpus) == 200_000
  assert corpus == data.stdlib_corpus(200_000)
  assert data.stdlib_corpus(1000) == corpus[:1000]
  assert b"def " in corpus and b"import " in corpus
  with pytest.raises(ValueError, match="max_bytes"):
    data.stdlib_corpus(0)


def test_text_corpus_file_and_folder(tmp_path: Path):
  (tmp_path / "b.txt").write_bytes(b"second\n")
  (tmp_path / "a.md").write_bytes(b"first\n")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "c.PY").write_bytes(b"third\n")
  (tmp_path / "image.png").write_bytes(b"\x89PNG")            # not a text suffix
  (tmp_path / ".hidden.txt").write_bytes(b"hidden\n")          # hidden: skipped
  assert data.text_corpus(tmp_path / "b.txt") == b"second\n"
  assert data.text_corpus(tmp_path / "image.png") == b"\x89PNG"  # a file is read as given
  assert data.text_corpus(tmp_path) == b"first\nsecond\nthird\n"
  assert data.text_corpus(str(tmp_path), max_bytes=8) == b"first\nse"


def test_text_corpus_errors_name_the_path(tmp_path: Path):
  missing = tmp_path / "nope"
  with pytest.raises(ValueError, match="does not exist") as err:
    data.text_corpus(missing)
  assert str(missing) in str(err.value)
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(ValueError, match="empty"):
    data.text_corpus(tmp_path / "empty.txt")
  with pytest.raises(ValueError, match="only empty"):
    data.text_corpus(tmp_path)
  (tmp_path / "no_text").mkdir()
  (tmp_path / "no_text" / "x.bin").write_bytes(b"\x00\x01")
  with pytest.raises(ValueError, match="no text files") as err:
    data.text_corpus(tmp_path / "no_text")
  assert "no_text" in str(err.value) and ".txt" in str(err.value)


def test_split():
  train, held_out = data.split(bytes(range(100)), 0.1)
  assert train == bytes(range(90)) and held_out == bytes(range(90, 100))
  for bad in (0.0, 1.0, -0.5):
    with pytest.raises(ValueError, match="eval_fraction"):
      data.split(b"abcdef", bad)
  with pytest.raises(ValueError, match="empty"):
    data.split(b"ab", 0.1)


def test_batches_are_windows_deterministic_per_seed():
  corpus = bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8))
  tokens = np.frombuffer(corpus, np.uint8)
  first = list(data.batches(corpus, batch_size=4, seq_len=32, seed=7, num_batches=5))
  again = list(itertools.islice(data.batches(corpus, 4, 32, seed=7), 5))  # endless form
  other = list(data.batches(corpus, 4, 32, seed=8, num_batches=5))
  assert len(first) == 5
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  assert not all(np.array_equal(a, b) for a, b in zip(first, other))
  for batch in first:
    assert batch.shape == (4, 33) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() <= 255
    for row in batch:  # every row is a contiguous window of the data
      start = np.flatnonzero(
          np.all(np.lib.stride_tricks.sliding_window_view(tokens, 33) == row, axis=1))
      assert start.size >= 1


def test_batches_cover_every_start_including_the_last():
  corpus = bytes(range(10))
  starts = {int(b[0, 0]) for b in data.batches(corpus, 1, 4, seed=0, num_batches=500)}
  assert starts == set(range(6))  # 10 bytes hold 6 windows of 5
  with pytest.raises(ValueError, match="shorter than one window"):
    next(data.batches(bytes(4), 1, 4))
  with pytest.raises(ValueError, match="batch_size"):
    next(data.batches(corpus, 0, 4))


def test_eval_batches_fixed_windows():
  corpus = bytes(i % 251 for i in range(1000))
  out = list(data.eval_batches(corpus, batch_size=3, seq_len=10))
  n_windows = (1000 - 1) // 10
  assert len(out) == n_windows // 3
  flat = np.concatenate(out)
  assert flat.shape == (len(out) * 3, 11) and flat.dtype == np.int32
  expected = np.frombuffer(corpus, np.uint8)[np.arange(len(flat))[:, None] * 10 + np.arange(11)]
  np.testing.assert_array_equal(flat, expected)
  again = list(data.eval_batches(corpus, 3, 10, max_batches=2))
  assert len(again) == 2 and all(np.array_equal(a, b) for a, b in zip(again, out))
  with pytest.raises(ValueError, match="fewer than batch_size"):
    next(data.eval_batches(bytes(30), batch_size=4, seq_len=10))


def _write_cifar(path: Path, images_NxHxWxC: np.ndarray, labels_N: np.ndarray) -> None:
  """Writes the official layout: label byte, then the R, G and B planes, each row-major."""
  records = [bytes([label]) + image.transpose(2, 0, 1).tobytes()
             for image, label in zip(images_NxHxWxC, labels_N)]
  path.write_bytes(b"".join(records))


def _random_cifar(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
          rng.integers(0, 10, n).astype(np.int32))


def test_load_cifar10_file_roundtrip_and_pixel_layout(tmp_path: Path):
  images, labels = _random_cifar(5, seed=0)
  path = tmp_path / "data_batch_1.bin"
  _write_cifar(path, images, labels)
  got_images, got_labels = data.load_cifar10(path)
  assert got_images.shape == (5, 32, 32, 3) and got_images.dtype == np.uint8
  assert got_labels.shape == (5,) and got_labels.dtype == np.int32
  np.testing.assert_array_equal(got_images, images)
  np.testing.assert_array_equal(got_labels, labels)
  raw = path.read_bytes()  # independent of the writer: offsets straight from the format spec
  for n, row, col, channel in [(0, 0, 0, 0), (1, 0, 31, 1), (2, 31, 0, 2), (4, 17, 5, 1)]:
    offset = n * 3073 + 1 + channel * 1024 + row * 32 + col
    assert got_images[n, row, col, channel] == raw[offset]
    assert got_labels[n] == raw[n * 3073]


def test_load_cifar10_folder_splits(tmp_path: Path):
  parts = [_random_cifar(2, seed) for seed in range(3)]
  _write_cifar(tmp_path / "data_batch_2.bin", *parts[1])
  _write_cifar(tmp_path / "data_batch_1.bin", *parts[0])
  _write_cifar(tmp_path / "test_batch.bin", *parts[2])
  (tmp_path / "batches.meta.txt").write_text("airplane\n")
  images, labels = data.load_cifar10(tmp_path)
  np.testing.assert_array_equal(images, np.concatenate([parts[0][0], parts[1][0]]))
  np.testing.assert_array_equal(labels, np.concatenate([parts[0][1], parts[1][1]]))
  test_images, test_labels = data.load_cifar10(tmp_path, split="test")
  np.testing.assert_array_equal(test_images, parts[2][0])
  np.testing.assert_array_equal(test_labels, parts[2][1])
  with pytest.raises(ValueError, match="split"):
    data.load_cifar10(tmp_path, split="valid")


def test_load_cifar10_rejects_malformed(tmp_path: Path):
  images, labels = _random_cifar(2, seed=1)
  truncated = tmp_path / "truncated.bin"
  _write_cifar(truncated, images, labels)
  truncated.write_bytes(truncated.read_bytes()[:-1])
  with pytest.raises(ValueError, match="multiple of the record size") as err:
    data.load_cifar10(truncated)
  assert "truncated.bin" in str(err.value)
  bad_label = tmp_path / "bad_label.bin"
  _write_cifar(bad_label, images, np.array([3, 10]))
  with pytest.raises(ValueError, match="record 1 has label 10") as err:
    data.load_cifar10(bad_label)
  assert "bad_label.bin" in str(err.value)
  (tmp_path / "empty.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="empty.bin"):
    data.load_cifar10(tmp_path / "empty.bin")
  with pytest.raises(ValueError, match="does not exist"):
    data.load_cifar10(tmp_path / "cifar-10-batches-bin")
  with pytest.raises(ValueError, match="data_batch_1.bin"):
    data.load_cifar10(tmp_path)  # a folder without batch files
