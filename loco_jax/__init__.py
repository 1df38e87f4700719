"""loco-jax: low-bit gradient communication for JAX (LoCo and CO3)."""

from loco_jax.loco import LocoState, loco, state_specs

__all__ = ["LocoState", "loco", "state_specs"]
__version__ = "0.1.0"
