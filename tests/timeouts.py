"""A step that must return: for tests where a hang (devices waiting for each other) is the bug."""

import threading

import jax
import pytest


def within(seconds: float, fn):
  """fn() in a thread, blocked on; fails the test if it has not returned within `seconds`.

  Blocked on inside the thread: test doubles (`tampering.tampering`) must still be in place when
  the step's callbacks run, and jax dispatches asynchronously."""
  result = []
  thread = threading.Thread(target=lambda: result.append(jax.block_until_ready(fn())),
                            daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    pytest.fail(f"the step did not return within {seconds} s: the devices hang")
  return result[0]
