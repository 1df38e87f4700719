"""Shared by the tests and the doctests: eight simulated CPU devices (set before jax is first
imported) and the names the public API's docstring examples use."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
  """`params` and `grads`: a small two-leaf tree, as in every optax example."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import loco_jax

  params = {"w": jnp.ones((4, 8)), "b": jnp.zeros((8,))}
  doctest_namespace.update(
      jax=jax, jnp=jnp, np=np, optax=optax, loco_jax=loco_jax, params=params,
      grads=jax.tree.map(lambda x: jnp.full_like(x, 0.01), params))
