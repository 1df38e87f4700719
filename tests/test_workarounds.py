"""The XLA:CPU workarounds: one switch, and what each does to the compiled step."""

import jax
import jax.numpy as jnp
import pytest

from loco_jax import loco
from loco_jax.core import workarounds


@pytest.mark.parametrize("switch,on", [(None, True), ("1", True), ("0", False)])
def test_one_switch_turns_them_all_on_or_off(monkeypatch, switch, on):
  if switch is None:
    monkeypatch.delenv("LOCO_JAX_WORKAROUNDS", raising=False)
  else:
    monkeypatch.setenv("LOCO_JAX_WORKAROUNDS", switch)
  assert workarounds.enabled() is (on and jax.default_backend() == "cpu")
  assert (workarounds.finite_first([jnp.ones(4)], local=True, has_bare_leaf=True)
          is None) is not workarounds.enabled()
  assert workarounds.finite_first([jnp.ones(4)], local=False, has_bare_leaf=True) is None


@pytest.mark.parametrize("switch", ["1", "0"])
def test_opaque_offsets_are_a_while_loop_only_where_enabled(monkeypatch, switch):
  monkeypatch.setenv("LOCO_JAX_WORKAROUNDS", switch)
  params = {"a": jnp.zeros((3, 64)), "b": jnp.zeros((3, 64))}
  opt = loco(block_size=64)
  hlo = jax.jit(opt.update).lower(params, opt.init(params)).as_text()
  assert ("while" in hlo) is workarounds.enabled()
  offsets = workarounds.opaque_offsets([0, 3, 7], jnp.int32(5))
  assert [int(x) for x in offsets] == [0, 3, 7]
