"""What crosses the wire: compressed collectives, the bucket exchange, wire chunking, and the
collectives (and their bytes) read from a compiled program.

The names of the former `loco_jax.comm` module (the leaf layout, the collectives, the HLO
accounting) are re-exported here, so code that used it keeps working.
"""

from loco_jax.comm import coded  # the coded exchange: byte rows in Huffman-coded slots
from loco_jax.comm.exchange import (WIDENING_BACKENDS, all_gather, all_to_all_mean, axis_size,
                                    decode_rows, encode_rows, gather_bf16, gather_packed,
                                    mean_16bit)
from loco_jax.comm.hlo import (Collective, async_collectives, collectives, collectives_per_step,
                               compiled_collectives, lowered_collectives, wire_bits_per_param)
from loco_jax.core.layout import (AxisName, LeafLayout, Payload, from_rows, leaf_layout,
                                  shard_len, shard_rows, to_rows)

__all__ = ["AxisName", "Collective", "coded", "LeafLayout", "Payload", "WIDENING_BACKENDS", "all_gather",
           "all_to_all_mean", "async_collectives", "axis_size", "collectives",
           "collectives_per_step", "compiled_collectives", "decode_rows", "encode_rows",
           "from_rows", "gather_bf16", "gather_packed", "leaf_layout", "lowered_collectives",
           "mean_16bit", "shard_len", "shard_rows", "to_rows", "wire_bits_per_param"]
