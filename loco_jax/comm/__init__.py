"""What crosses the wire: byte framing, the collectives, LoCo's bucket all-to-all, the coded
exchange, wire chunking, and the collectives (and their bytes) read from a compiled program."""

from loco_jax.comm import coded  # the coded exchange: byte rows in Huffman-coded slots
from loco_jax.comm.gathers import (WIDENING_BACKENDS, all_gather, axis_size, gather_bf16,
                                       gather_packed, mean_16bit)
from loco_jax.comm.hlo import (Collective, async_collectives, collectives, collectives_per_step,
                               compiled_collectives, lowered_collectives, wire_bits_per_param)

__all__ = ["Collective", "WIDENING_BACKENDS", "all_gather", "async_collectives", "axis_size",
           "coded", "collectives", "collectives_per_step", "compiled_collectives", "gather_bf16",
           "gather_packed", "lowered_collectives", "mean_16bit", "wire_bits_per_param"]
