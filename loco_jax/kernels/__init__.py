"""The fused LoCo compress step (compensate, quantize, pack, error update) and the receive-side
mean, in jnp and as Pallas kernels, each held to the float64 reference (`kernels.reference`)."""

from loco_jax.kernels.arithmetic import (CPU_TILE_BLOCKS, GPU_MIN_BLOCK, IMPLEMENTATIONS,
                                         NUM_WARPS, TILE_BLOCKS, UNROLLED_PEERS, Compressed)
from loco_jax.kernels.step import (chosen_implementation, compress_step, dequantize_mean,
                                   implementation_report, pallas_report)

__all__ = ["CPU_TILE_BLOCKS", "Compressed", "GPU_MIN_BLOCK", "IMPLEMENTATIONS", "NUM_WARPS",
           "TILE_BLOCKS", "UNROLLED_PEERS", "chosen_implementation", "compress_step",
           "dequantize_mean", "implementation_report", "pallas_report"]
