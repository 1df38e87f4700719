"""The fused LoCo compress step and the receive-side mean: which implementation runs (jnp,
or Pallas once it matches the float64 reference here), and the public entry points."""

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np

from loco_jax.core import quant
from loco_jax.kernels import pallas, reference
from loco_jax.kernels.arithmetic import (GPU_MIN_BLOCK, IMPLEMENTATIONS, TILE_BLOCKS,
                                         UNROLLED_PEERS, Compressed, compress_jnp, is_constant,
                                         mean_jnp)
from loco_jax.kernels.pallas import compress_pallas, mean_pallas


def _pallas_unsupported(bits: int, block_size: int, beta, backend: str, peers: int = 1,
                        fixed=(None, None)) -> str | None:
  """Why the Pallas path cannot run these settings (None when it can)."""
  if pallas.pl is None:
    return "jax.experimental.pallas does not import here"
  if 8 % bits:
    return f"bits={bits} does not divide 8 (bit-plane packing is jnp only)"
  if not all(is_constant(x) for x in (beta, *fixed)):
    return "beta or a fixed scale is traced (the kernel bakes them in as constants)"
  if backend == "gpu" and block_size & (block_size - 1):
    return f"Triton tiles need a power-of-two block_size, got {block_size}"
  if backend == "gpu" and peers & (peers - 1):
    return f"Triton tiles need a power-of-two number of peers, got {peers}"
  if backend == "gpu" and block_size < GPU_MIN_BLOCK:
    return f"blocks of {block_size} < {GPU_MIN_BLOCK} values run on jnp (Triton tiles that small)"
  return None


def _check_data(blocks: int, block_size: int, seed: int) -> np.ndarray:
  """Normal values whose blocks differ in magnitude by about e**12, one all-zero block."""
  rng = np.random.default_rng(seed)
  magnitude = np.exp(3 * rng.standard_normal((blocks, 1)))
  g = rng.standard_normal((blocks, block_size)) * magnitude
  g[blocks // 2] = 0.0
  return g.astype(np.float32)


@functools.cache
def implementation_report(implementation: str, backend: str, bits: int = 4,
                          error_bits: int = 8, beta: float = 0.8, block_size: int = 2048,
                          tile_blocks: int | None = None, num_warps: int | None = None,
                          interpret: bool | None = None, scale_method: str = "absmax",
                          clip_rms: float | None = None) -> str:
  """"pass" if `implementation` runs here and its steps and receive-side mean agree with the
  float64 reference (`reference.check_step`, `reference.mean_off`) within float32 rounding,
  else "fail: ..." (what was off) or "error: ..." (why it did not run).

  Three compress steps (the third after a reset) and a dequantize_mean; cached.

  Example:
    >>> implementation_report("jnp", "cpu")
    'pass'
  """
  def run(fn, *args):  # compiled and called directly: safe while an outer jit is tracing
    return jax.jit(fn).lower(*args).compile()(*args)

  if backend != jax.default_backend():
    return f"error: asked about {backend!r}, but this process runs on {jax.default_backend()!r}"
  blocks = 4 * (tile_blocks or TILE_BLOCKS.get(backend, 1))
  options = dict(bits=bits, implementation=implementation, tile_blocks=tile_blocks,
                 num_warps=num_warps, interpret=interpret)
  problems = []
  try:
    error, error_scale = np.zeros(blocks * block_size, np.int8), np.zeros(blocks, np.float32)
    payloads = []
    for k in range(3):
      g = _check_data(blocks, block_size, k)
      step = functools.partial(compress_step, error_bits=error_bits, beta=beta, reset=k == 2,
                               block_size=block_size, decompressed=True,
                               scale_method=scale_method, clip_rms=clip_rms, **options)
      out = Compressed(*[np.asarray(x) for x in run(step, g.reshape(-1), error, error_scale)])
      codes = np.asarray(quant.unpack(out.packed, bits))
      found = reference.check_step(
          g, error.reshape(blocks, -1), error_scale, codes, out.scales,
          out.error.reshape(blocks, -1), out.error_scale, out.decompressed.reshape(blocks, -1),
          bits=bits, error_bits=error_bits, beta=beta, reset=k == 2, scale_method=scale_method,
          clip_rms=clip_rms)
      problems += [f"step {k}: {found}"] if not found.passed else []
      problems += [f"step {k}: finite=False on finite data"] if not out.finite else []
      payloads.append((out.packed.reshape(-1), out.scales, codes))
      error, error_scale = out.error, out.error_scale
    received, scales, codes = [np.stack(x) for x in zip(*payloads)]
    mean = run(functools.partial(dequantize_mean, **options), received, scales)
  except Exception as e:  # noqa: BLE001 - any lowering or runtime failure means "do not use it"
    return f"error: {implementation}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
  off = reference.mean_off(np.asarray(mean), codes, scales)
  problems += [f"dequantize_mean: {off} elements off"] if off else []
  return "pass" if not problems else "fail: " + "; ".join(problems)


def pallas_report(backend: str, bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                  block_size: int = 2048, tile_blocks: int | None = None,
                  num_warps: int | None = None, interpret: bool | None = None,
                  scale_method: str = "absmax", clip_rms: float | None = None) -> str:
  """`implementation_report` of the Pallas kernels: "pass" where `auto` may pick them.

  Example:
    >>> pallas_report("gpu", tile_blocks=8, num_warps=8)   # "pass" on a GPU
    "error: asked about 'gpu', but this process runs on 'cpu'"
  """
  return implementation_report("pallas", backend, bits, error_bits, beta, block_size,
                               tile_blocks, num_warps, interpret, scale_method, clip_rms)


def outside_traces(fn, *args):
  """`fn(*args)` on a thread of its own, outside the caller's traces (they are per thread).

  Example:
    >>> outside_traces(implementation_report, "jnp", "cpu")
    'pass'
  """
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(fn, *args).result()


def _resolve(implementation: str, bits: int, error_bits: int, beta, block_size: int,
             tile_blocks, num_warps, interpret, peers: int = 1,
             fixed=(None, None), scaling=("absmax", None)) -> tuple[str, str]:
  """("jnp" | "pallas", backend) for a call with these settings (`peers` shards)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  backend = jax.default_backend()
  if implementation == "jnp":
    return "jnp", backend
  why_not = _pallas_unsupported(bits, block_size, beta, backend, peers, fixed)
  if implementation == "pallas":
    if why_not:
      raise ValueError(f"implementation='pallas' cannot run here: {why_not}")
    return "pallas", backend
  if why_not or backend not in ("gpu", "tpu") or interpret:
    return "jnp", backend  # on CPU Pallas only interprets: slower than XLA
  # One check per (bits, error_bits, beta, scaling): it runs with computed block scales and
  # blocks of 2048 (a fixed scale only replaces a computed value by a constant; the tests cover
  # other blocks).
  passed = outside_traces(pallas_report, backend, bits, error_bits, float(beta), 2048,
                          tile_blocks, num_warps, None, *scaling) == "pass"
  return ("pallas" if passed else "jnp"), backend


def chosen_implementation(bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                          block_size: int = 2048, tile_blocks: int | None = None,
                          num_warps: int | None = None, scale_method: str = "absmax",
                          clip_rms: float | None = None) -> str:
  """What `implementation="auto"` runs on the current backend: "pallas" or "jnp".

  Example:
    >>> chosen_implementation()   # on CPU
    'jnp'
  """
  return _resolve("auto", bits, error_bits, beta, block_size, tile_blocks, num_warps, None,
                  scaling=(scale_method, clip_rms))[0]


def _check_compress(size: int, error, error_scale, fixed_error_scale, bits: int,
                    error_bits: int, block_size: int) -> int:
  quant.check_bits(bits)
  quant.check_bits(error_bits, "error_bits")
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or (
      block_size <= 0 or block_size % quant.PACK_UNIT):
    raise ValueError(f"block_size must be a positive multiple of {quant.PACK_UNIT}, got "
                     f"{block_size!r}")
  if size == 0 or size % block_size:
    raise ValueError(f"compress_step needs a size that is a positive multiple of block_size="
                     f"{block_size}, got {size} (loco() handles ragged leaves)")
  blocks = size // block_size
  if error.shape != (size,) or error.dtype != jnp.int8:
    raise ValueError(f"error must be int8 [{size}], got {error.dtype} {tuple(error.shape)}")
  if (error_scale is None) == (fixed_error_scale is None):
    raise ValueError("pass the stored error's block scales (error_scale) or a fixed_error_scale, "
                     "exactly one of them")
  if error_scale is not None and error_scale.shape != (blocks,):
    raise ValueError(f"error_scale must be float32 [{blocks}] (one per block), got "
                     f"{tuple(error_scale.shape)}")
  return blocks


def compress_step(g: jax.Array, error: jax.Array, error_scale: jax.Array | None, *,
                  bits: int = 4, error_bits: int = 8, beta: float = 0.8,
                  reset: jax.Array | bool = False, block_size: int = 2048,
                  decompressed: bool = False, fixed_scale: float | None = None,
                  fixed_error_scale: float | None = None, implementation: str = "auto",
                  tile_blocks: int | None = None, num_warps: int | None = None,
                  interpret: bool | None = None, scale_method: str = "absmax",
                  clip_rms: float | None = None, skip: jax.Array | None = None) -> Compressed:
  """LoCo's step on a flat vector whose size is a multiple of block_size.

  What `loco()` runs on each bucket: e = error / error_scale (0 if `reset`), h = g + e,
  q = compress(h; s) with per-block s = qmax / max|h| (`fixed_scale`, or `quant.rms_scale`'s
  with scale_method="rms"), d = q / s, error' = compress(beta e + (1 - beta)(h - d); per-block
  absmax or `fixed_error_scale`, error_bits).
  `implementation`: "pallas" is one kernel, a program per `tile_blocks` blocks; "jnp" the XLA
  formulation; "auto" takes Pallas on GPU/TPU where `pallas_report` passes, else jnp. Each
  agrees with `reference.check_step` within float32 rounding. A non-finite g gives
  finite=False and unspecified other outputs; a finite g gives finite, saturated outputs.
  `skip` (bool []): a step known beforehand to be skipped, as loco's local mode on CPU checks
  the gradients first: where true, `error` and `error_scale` come back as given (no reset) and
  `decompressed` is NaN (the payload is unspecified), in the same pass as the step.

  Example:
    >>> g = jnp.linspace(-1.0, 1.0, 2 * 2048)
    >>> out = compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(g.size // 2048))
    >>> out.packed.shape, out.error.dtype
    ((2, 1024), dtype('int8'))
  """
  blocks = _check_compress(g.size, error, error_scale, fixed_error_scale, bits, error_bits,
                           block_size)
  quant.check_scale_method(scale_method, clip_rms)
  if skip is not None and (jnp.shape(skip) != () or jnp.result_type(skip) != jnp.bool_):
    raise ValueError(f"skip must be a bool scalar (or None), got {jnp.result_type(skip)} "
                     f"{tuple(jnp.shape(skip))}")
  if fixed_scale is not None and scale_method != "absmax":
    raise ValueError(f"scale_method={scale_method!r} computes block scales; a fixed_scale "
                     f"replaces them: pass one or the other")
  name, backend = _resolve(implementation, bits, error_bits, beta, block_size, tile_blocks,
                           num_warps, interpret, fixed=(fixed_scale, fixed_error_scale),
                           scaling=(scale_method, clip_rms))
  g_BxL = g.reshape(blocks, block_size).astype(jnp.float32)
  error_BxL = error.reshape(blocks, block_size)
  stored = (jnp.full((blocks,), fixed_error_scale, jnp.float32) if error_scale is None
            else error_scale.astype(jnp.float32))
  # A reset zeroes the error: a zero scale decompresses to exactly 0, as loco's where() does.
  stored = jnp.where(reset, 0.0, stored)
  args = (g_BxL, error_BxL, stored, bits, error_bits, beta, fixed_scale, fixed_error_scale,
          decompressed, backend)
  scaling = dict(scale_method=scale_method, clip_rms=clip_rms)
  if name == "jnp":
    out = Compressed(*compress_jnp(*args, **scaling, skip=skip))
  else:
    out = Compressed(*compress_pallas(*args, interpret, tile_blocks, num_warps, **scaling))
    if skip is not None:  # the kernel takes no skip: the same selects, after it
      nan = None if out.decompressed is None else jnp.where(skip, jnp.nan, out.decompressed)
      out = out._replace(error=jnp.where(skip, error, out.error), decompressed=nan)
  if skip is not None and error_scale is not None:
    out = out._replace(error_scale=jnp.where(skip, error_scale.astype(jnp.float32),
                                             out.error_scale))
  return out


def dequantize_mean(received: jax.Array, scales: jax.Array, *, bits: int = 4,
                    implementation: str = "auto", tile_blocks: int | None = None,
                    num_warps: int | None = None, interpret: bool | None = None) -> jax.Array:
  """The float32 mean of N peers' packed shards: a device's work after the all-to-all.

  `received` is uint8 [N, blocks * block_len * bits / 8] (row j from peer j, quant.pack's
  layout within each block), `scales` float32 [N, blocks]; returns the float32 mean over j of
  q_j / s_j (0 where s_j is 0), [blocks * block_len], without overflow (`quant.mean_factors`).

  Example:
    >>> g = jnp.linspace(-1.0, 1.0, 2048)
    >>> a = compress_step(g, jnp.zeros(g.size, jnp.int8), jnp.zeros(1))
    >>> b = compress_step(-g, jnp.zeros(g.size, jnp.int8), jnp.zeros(1))
    >>> mean = dequantize_mean(jnp.stack([a.packed.reshape(-1), b.packed.reshape(-1)]),
    ...                        jnp.stack([a.scales, b.scales]))
    >>> float(jnp.abs(mean).max())   # the two peers' gradients cancel
    0.0
  """
  quant.check_bits(bits)
  if received.ndim != 2 or scales.ndim != 2 or received.shape[0] != scales.shape[0]:
    raise ValueError(f"received must be [N, bytes] and scales [N, blocks] with the same N, got "
                     f"{tuple(received.shape)} and {tuple(scales.shape)}")
  shards, nbytes = received.shape
  blocks = scales.shape[1]
  if shards == 0 or blocks == 0 or nbytes % blocks or (nbytes // blocks) % bits:
    raise ValueError(f"{nbytes} bytes a shard do not split into {blocks} blocks of whole "
                     f"{bits}-bit packing units")
  block_len = nbytes // blocks * 8 // bits
  name, backend = _resolve(implementation, bits, 8, 0.8, block_len, tile_blocks, num_warps,
                           interpret, peers=shards)
  packed_NxBxP = received.reshape(shards, blocks, nbytes // blocks)
  if name == "jnp":
    return mean_jnp(packed_NxBxP, scales.astype(jnp.float32), bits,
                    unroll=backend != "cpu" and shards <= UNROLLED_PEERS)
  return mean_pallas(packed_NxBxP, scales.astype(jnp.float32), bits, backend, interpret,
                      tile_blocks, num_warps)
