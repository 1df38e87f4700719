"""On the GPU: how XLA:GPU and Triton round the kernels' float32 operations, and how fast the
Pallas compress kernel runs by tile, warps, pipeline stages and arithmetic.

  python experiments/gpu_kernel_probe.py [--n-params 268435456] [--repeats 10]

Part 1 counts, for each operation, the elements (of 2**22 random float32 triples spanning
e**+-9) where XLA:GPU, Triton's own arithmetic and explicit PTX differ from numpy's correctly
rounded float32 result: it says which PTX the jnp path's arithmetic is, so that the Pallas
kernel can use the same. Part 2 times kernels.compress_step's Pallas kernel with each
configuration against a device copy of the same bytes and optax.adamw (medians, interleaved).
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from loco_jax import bench, kernels

BLOCK = 1024
INTERPRET = False  # --smoke: the Pallas interpreter on CPU, to check this script itself


def _asm(code: str, *args):
  args = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float32) for a in args])
  return pltriton.elementwise_inline_asm(
      code, args=list(args), constraints="=r" + ",r" * len(args), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])[0]


# name -> (numpy float32 reference, jnp form (XLA and Triton's own), explicit PTX forms)
OPERATIONS = {
    "div": (lambda a, b, c: a / b, lambda a, b, c: a / b,
            {"div.rn": lambda a, b, c: _asm("div.rn.f32 $0, $1, $2;", a, b),
             "div.full": lambda a, b, c: _asm("div.full.f32 $0, $1, $2;", a, b),
             "div.approx": lambda a, b, c: _asm("div.approx.f32 $0, $1, $2;", a, b)}),
    "reciprocal": (lambda a, b, c: np.float32(1) / b, lambda a, b, c: 1.0 / b,
                   {"rcp.rn": lambda a, b, c: _asm("rcp.rn.f32 $0, $1;", b),
                    "rcp.approx": lambda a, b, c: _asm("rcp.approx.f32 $0, $1;", b)}),
    "mul_add": (lambda a, b, c: a + b * c, lambda a, b, c: a + b * c,
                {"mul.rn+add.rn": lambda a, b, c: _asm(
                    "add.rn.f32 $0, $1, $2;", a, _asm("mul.rn.f32 $0, $1, $2;", b, c)),
                 "fma.rn": lambda a, b, c: _asm("fma.rn.f32 $0, $1, $2, $3;", b, c, a)}),
    "sealed_mul_add": (lambda a, b, c: a + b * c,
                       lambda a, b, c: a + kernels._sealed(b * c), {}),
    "round": (lambda a, b, c: np.round(a * b), lambda a, b, c: jnp.round(a * b),
              {"mul.rn+cvt.rni": lambda a, b, c: _asm(
                  "cvt.rni.f32.f32 $0, $1;", _asm("mul.rn.f32 $0, $1, $2;", a, b))}),
}


def _elementwise_pallas(fn, a, b, c):
  def kernel(a_ref, b_ref, c_ref, o_ref):
    o_ref[...] = fn(a_ref[...], b_ref[...], c_ref[...])
  spec = pl.BlockSpec((BLOCK,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.float32),
                        grid=(a.size // BLOCK,), in_specs=[spec] * 3, out_specs=spec,
                        interpret=INTERPRET)(a, b, c)


def rounding_table(n: int) -> list[tuple[str, str, int]]:
  rng = np.random.default_rng(0)
  a, b, c = [(rng.standard_normal(n) * np.exp(3 * rng.standard_normal(n))).astype(np.float32)
             for _ in range(3)]
  rows = []
  with np.errstate(all="ignore"):
    for op, (reference, jnp_form, ptx) in OPERATIONS.items():
      want = reference(a, b, c).astype(np.float32)
      forms = {"xla": lambda *x: jax.jit(jnp_form)(*x),
               "triton": lambda *x: jax.jit(functools.partial(_elementwise_pallas, jnp_form))(*x)}
      forms.update({f"ptx {k}": (lambda *x, f=f: jax.jit(
          functools.partial(_elementwise_pallas, f))(*x)) for k, f in ptx.items()
                    if not INTERPRET})
      for name, run in forms.items():
        try:
          got = np.asarray(run(a, b, c))
          rows.append((op, name, int(np.sum(got.view(np.int32) != want.view(np.int32)))))
        except Exception as e:  # noqa: BLE001 - a form that does not compile is a finding
          rows.append((op, name, -1))
          print(f"probe: {op} {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
  return rows


def _compress(g, error, error_scale, tile, warps, stages, ops):
  """kernels._compress_pallas with every setting explicit (4 bits, 8-bit error, beta 0.8)."""
  blocks, block_size = g.shape
  nbytes = block_size // 2
  rows = lambda width: pl.BlockSpec((tile, width), lambda i: (i, 0))
  shapes = [((blocks, nbytes), jnp.uint8), ((blocks, 1), jnp.float32),
            ((blocks, block_size), jnp.int8), ((blocks, 1), jnp.float32),
            ((blocks, 1), jnp.int32)]
  return pl.pallas_call(
      functools.partial(kernels._compress_kernel, bits=4, error_bits=8, beta=0.8, ops=ops),
      out_shape=[jax.ShapeDtypeStruct(s, t) for s, t in shapes], grid=(blocks // tile,),
      in_specs=[rows(block_size), rows(block_size), rows(1)],
      out_specs=[rows(s[1]) for s, _ in shapes],
      compiler_params=None if INTERPRET else pltriton.CompilerParams(num_warps=warps,
                                                                     num_stages=stages),
      interpret=INTERPRET,
  )(g, error, error_scale[:, None])


VARIANTS = [  # (arithmetic, tile blocks, warps, stages)
    ("ptx", 1, 1, 1), ("ptx", 1, 2, 1), ("ptx", 1, 4, 1), ("ptx", 1, 8, 1), ("ptx", 2, 4, 1),
    ("ptx", 1, 4, 3),
    ("triton", 1, 2, 1), ("triton", 1, 4, 1), ("triton", 2, 4, 1), ("triton", 2, 8, 1),
]


def timing_table(n: int, repeats: int) -> list[tuple[str, float]]:
  g = jax.random.normal(jax.random.key(0), (n // 2048, 2048), jnp.float32)
  blocks = n // 2048
  adamw = optax.adamw(1e-3)
  flat = g.reshape(-1)
  cands = [bench._Candidate("adamw", jax.jit(lambda x, p, s: adamw.update(x, s, p),
                                             donate_argnums=2),
                            adamw.init(flat), (flat, flat), keep=lambda out: out[1]),
           bench._Candidate("copy_6.5B", jax.jit(lambda x: x + jnp.uint32(1), donate_argnums=0),
                            jnp.zeros(n * 13 // 16, jnp.uint32))]
  # "triton": Triton's own multiply, add and division (contracted, div.full); rounding stays
  # PTX (Triton has no round-half-even).
  ptx = kernels._XLA_OPS if INTERPRET else kernels._triton_ops()
  ops = {"ptx": ptx, "triton": kernels._XLA_OPS._replace(round=ptx.round)}
  for arith, tile, warps, stages in VARIANTS:
    step = jax.jit(lambda x, state, t=tile, w=warps, s=stages, o=ops[arith]: (
        lambda out: (out[0], out[1], out[4], (out[2], out[3][:, 0])))(
            _compress(x, *state, t, w, s, o)), donate_argnums=1)
    name = f"{arith}_tile{tile}_warps{warps}_stages{stages}"
    try:
      state = (jnp.zeros((blocks, 2048), jnp.int8), jnp.zeros(blocks, jnp.float32))
      jax.block_until_ready(step(g, state))
      state = (jnp.zeros((blocks, 2048), jnp.int8), jnp.zeros(blocks, jnp.float32))
      cands.append(bench._Candidate(name, step, state, (g,), keep=lambda out: out[3]))
    except Exception as e:  # noqa: BLE001
      print(f"probe: {name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
  seconds = bench._time_interleaved(cands, repeats)
  return [(name, s) for name, s in seconds.items()]


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--n-params", type=int, default=1 << 28)
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes")
  args = p.parse_args()
  if args.smoke:
    global INTERPRET
    INTERPRET, args.n_params, args.repeats = True, 4 * 2048, 2
  elif jax.default_backend() != "gpu":
    print(f"gpu_kernel_probe: needs a GPU, backend is {jax.default_backend()}", file=sys.stderr)
    return 2
  size = 4 * BLOCK if INTERPRET else 1 << 22
  print(f"## Rounding against numpy float32 (elements differing of {size}; -1: failed)\n")
  print("| operation | form | differing |\n|---|---|---|")
  for op, name, count in rounding_table(size):
    print(f"| {op} | {name} | {count} |")
  n = args.n_params
  print(f"\n## Compress kernel, n = {n}, median of {args.repeats} (interleaved)\n")
  print("| variant | ms | vs adamw | GB/s at 6.5 B/elem | vs copy |\n|---|---|---|---|---|")
  seconds = dict(timing_table(n, args.repeats))
  for name, s in seconds.items():
    print(f"| {name} | {s * 1e3:.3f} | {s / seconds['adamw']:.3f} | "
          f"{n * 6.5 / s / 1e9:.0f} | {seconds['copy_6.5B'] / s:.3f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
