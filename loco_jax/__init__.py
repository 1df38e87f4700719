"""loco-jax: low-bit gradient communication for JAX (LoCo and CO3).

Layout: `core` (quantizer, leaf layout, buckets), `kernels` (the fused compress step and the
receive-side mean), `comm` (what crosses the wire), `codecs` (small floats, GenNorm, Huffman),
`transforms` (loco, two_hop, co3, baselines), `train` (sharded train steps, checkpoints);
`apps` (demo, benchmarks, example models) runs the library and is never imported by it.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from loco_jax.transforms.co3 import Co3State, co3
from loco_jax.transforms.hierarchical import TwoHopState, two_hop
from loco_jax.transforms.loco import LocoState, loco, state_specs

__all__ = ["Co3State", "LocoState", "TwoHopState", "co3", "loco", "state_specs", "two_hop"]
__version__ = "0.1.0"

# Module paths from before the subpackages (`loco_jax.parallel`, `loco_jax.huffman`, ...) keep
# working: each is the module at its new home. `loco` and `co3` are also this package's
# functions, so their modules are registered now rather than set as attributes on import.
MOVED = {
    "quant": "core.quant", "buckets": "core.buckets", "trees": "core.trees",
    "wire": "comm.wire", "reference": "kernels.reference",
    "fp": "codecs.fp", "gennorm": "codecs.gennorm", "huffman": "codecs.huffman",
    "huffman_jnp": "codecs.huffman_jnp",
    "loco": "transforms.loco", "hierarchical": "transforms.hierarchical",
    "co3": "transforms.co3", "baselines": "transforms.baselines",
    "parallel": "train.parallel", "fsdp": "train.fsdp", "masks": "train.masks",
    "checkpoint": "train.checkpoint", "files": "train.files",
}
for _old in ("loco", "hierarchical", "co3"):
  sys.modules[f"{__name__}.{_old}"] = sys.modules[f"{__name__}.{MOVED[_old]}"]


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports `loco_jax.<old>` as the module at its new home (the same module object)."""

  def find_spec(self, fullname, path=None, target=None):
    package, _, old = fullname.rpartition(".")
    if package != __name__ or old not in MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, self)

  def create_module(self, spec):
    return importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")

  def exec_module(self, module):
    pass  # already executed at its new home


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
  sys.meta_path.append(_Alias())
