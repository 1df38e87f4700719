"""pytest plugin of experiments/optax_suite.py: optax.sgd, adam and adamw (and their
`optax._src.alias` originals) return `optax.chain(compressor, optimizer)`, the compressor named by
$LOCO_JAX_OPTAX_COMPRESSOR. Loaded with `-p optax_suite_plugin` before optax's test modules are
collected, so that the tables they build at import time hold the chained optimizers too. Only
the tests that build one of them run (their source or their parameters name sgd or adam): the
others would test optax alone."""

import functools
import inspect
import os
import re

import optax
from optax._src import alias

import loco_jax

COMPRESSORS = {
    "loco4": lambda: loco_jax.loco(bits=4),
    "loco8": lambda: loco_jax.loco(bits=8),
    "loco4-fixed": lambda: loco_jax.loco(bits=4, scale=64.0, error_scale=256.0),
    "co3-fp4": lambda: loco_jax.co3("fp4"),
    "co3-fp8": lambda: loco_jax.co3("fp8"),
    "bf16": loco_jax.bf16,
    "int8": lambda: loco_jax.int_quantized(bits=8),
    "error_feedback": loco_jax.error_feedback,
    "ef21": loco_jax.ef21,
    "sign_ef": loco_jax.sign_ef,
    "topk_ef": loco_jax.topk_ef,
    "uncompressed": loco_jax.uncompressed,
}


def _chained(optimizer, make_compressor):
  @functools.wraps(optimizer)
  def build(*args, **kwargs):
    return optax.chain(make_compressor(), optimizer(*args, **kwargs))
  return build


def pytest_configure(config):
  del config
  make = COMPRESSORS[os.environ["LOCO_JAX_OPTAX_COMPRESSOR"]]
  for name in ("sgd", "adam", "adamw"):
    chained = _chained(getattr(alias, name), make)
    setattr(alias, name, chained)
    setattr(optax, name, chained)


_BUILDS_ONE = re.compile(r"(?<![a-z])(sgd|adam|adamw)(?![a-z])")


def _builds_a_chained_optimizer(item) -> bool:
  """A test parametrized over optimizers by its parameters (or its name, absl's way), else by
  its source."""
  function = getattr(item, "function", None)
  if function is None:
    return False
  if _BUILDS_ONE.search(item.name):
    return True
  params = getattr(getattr(item, "callspec", None), "params", None)
  if params:
    return any(_BUILDS_ONE.search(getattr(v, "__name__", "") + repr(v)) for v in params.values())
  absl_params = getattr(getattr(item, "obj", None), "__x_params_repr__", None)
  if absl_params is not None:  # absl's parameterized: the generated test's parameters
    return bool(_BUILDS_ONE.search(absl_params))
  return bool(_BUILDS_ONE.search(inspect.getsource(function)))


def pytest_collection_modifyitems(config, items):
  kept = [item for item in items if _builds_a_chained_optimizer(item)]
  config.hook.pytest_deselected(items=[item for item in items if item not in kept])
  items[:] = kept
