"""README's recipes run as written: the optax chain, the 1-D mesh step, zero2, the (data, model)
mesh step, each block executed in order in one namespace, as a reader pastes them."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
# What the zero2 block takes from the reader's own program.
ZERO2_INPUTS = """
loss_fn = lambda p, batch: jnp.mean((batch @ p["w"] + p["b"]) ** 2)
batch = jnp.ones((16, 16))
"""


def _blocks(section: str, end: str) -> list[str]:
  text = README.read_text()
  text = text[text.index(section): text.index(end)]
  return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.slow
def test_the_loco_recipes_run_as_written():
  blocks = _blocks("## LoCo as an optax transformation", "### Fully sharded")
  assert len(blocks) == 4, "the optax chain, the 1-D mesh, zero2, the (data, model) mesh"
  scope = {}
  exec(blocks[0], scope)
  assert jax.tree.map(jnp.shape, scope["updates"]) == jax.tree.map(jnp.shape, scope["params"])
  exec(blocks[1], scope)
  # Every device gave the same gradient: the mean is that gradient within 4-bit rounding,
  # and adamw's first step moves each parameter by about the learning rate.
  assert np.allclose(np.abs(np.asarray(scope["updates"]["w"])), 3e-4, rtol=0.05)
  exec(ZERO2_INPUTS + blocks[2], scope)
  assert np.isfinite(float(scope["loss"]))
  exec(blocks[3], scope)
  assert scope["updates"]["w"].shape == (16, 8)
  assert np.allclose(np.abs(np.asarray(scope["updates"]["w"])), 3e-4, rtol=0.05)
