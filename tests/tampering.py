"""A test double for a peer that tampers with its streams: it wraps the coded exchange's coder."""

import contextlib
import types
from typing import Callable, Iterator

from loco_jax.comm import coded

# (sender, destination (-1: all, in a gather), stream) -> the stream sent instead.
Hook = Callable[[int, int, bytes], bytes]


@contextlib.contextmanager
def tampering(hook: Hook) -> Iterator[None]:
  """Streams coded inside (host side, every device) are replaced by `hook`'s result: for tests
  of what receivers do with a peer's short, truncated or corrupt stream.

  Block on the step inside (`timeouts.within` does): jax dispatches asynchronously, and the
  host callbacks must run while the double is in place.
  """
  fill_slots = coded.fill_slots

  def tampered(rows_NxB, sender, capacity, coder, skip):
    # fill_slots codes the rows in order, all but `skip`.
    destinations = iter([j if skip >= 0 else -1 for j in range(len(rows_NxB)) if j != skip])
    spy = types.SimpleNamespace(
        encode=lambda row: hook(int(sender), next(destinations), coder.encode(row)),
        decode=coder.decode, overhead=coder.overhead)
    return fill_slots(rows_NxB, sender, capacity, spy, skip)

  coded.fill_slots = tampered
  try:
    yield
  finally:
    coded.fill_slots = fill_slots
