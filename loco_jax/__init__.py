"""loco-jax: low-bit gradient communication for JAX (LoCo and CO3).

The optax transformations are re-exported here; the layers are subpackages: `core` (quantizer,
leaf layout, buckets, the leaf core), `kernels` (the fused compress step and the receive-side
mean), `comm` (what crosses the wire), `codecs` (small floats, GenNorm, Huffman),
`transforms` (loco, two_hop, co3, baselines), `train` (sharded train steps, checkpoints).
`apps` (demo, benchmarks, example models) runs the library and is never imported by it.
"""

from loco_jax import codecs, comm, core, kernels, train, transforms
from loco_jax.transforms import (Co3State, EF21State, ErrorFeedbackState, LocoState,
                                 TwoHopState, bf16, co3, defaults_for, ef21, error_by_leaf,
                                 error_feedback, int_quantized, loco, sign_ef, state_specs,
                                 topk_ef, two_hop, uncompressed)

__all__ = ["Co3State", "EF21State", "ErrorFeedbackState", "LocoState", "TwoHopState", "bf16",
           "co3", "codecs", "comm", "core", "defaults_for", "ef21", "error_by_leaf",
           "error_feedback", "int_quantized", "kernels", "loco", "sign_ef", "state_specs",
           "topk_ef", "train", "transforms", "two_hop", "uncompressed"]
__version__ = "0.1.0"
