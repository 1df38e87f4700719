"""loco-jax: low-bit gradient communication for JAX (LoCo and CO3)."""

from loco_jax.co3 import Co3State, co3
from loco_jax.hierarchical import TwoHopState, two_hop
from loco_jax.loco import LocoState, loco, state_specs

__all__ = ["Co3State", "LocoState", "TwoHopState", "co3", "loco", "state_specs", "two_hop"]
__version__ = "0.1.0"
