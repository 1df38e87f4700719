"""On the GPU: how XLA:GPU and Triton round the kernels' float32 operations, and how fast the
Pallas compress kernel runs by tile, warps, pipeline stages and arithmetic.

  python experiments/gpu_kernel_probe.py [--n-params 268435456] [--repeats 10]
                                         [--skip-rounding] [--smoke (CPU interpreter)]

Part 1 counts, for each operation, the elements (of 2**22 random float32 triples spanning
e**+-9) where XLA:GPU, Triton's own arithmetic and explicit PTX differ from numpy's correctly
rounded float32 result: it says which PTX the jnp path's arithmetic is, so that the Pallas
kernel can use the same. Part 2 times the compress kernel in each layout (kernels.py's grid of
tiles; persistent programs looping over blocks) and configuration against a device copy of the
same bytes and optax.adamw (medians, interleaved), each checked bit for bit against the jnp path.
Results of the H200 runs: docs/PERFORMANCE.md.
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


def _persistent(g, error, error_scale, programs, warps, stages, ops):
  """The same step with `programs` program instances, each looping over blocks pid,
  pid + programs, ...: Triton can then prefetch a block while it computes the last one."""
  blocks, block_size = g.shape
  width = block_size // 2
  planes = [pl.ds(t * width, width) for t in range(2)]

  def kernel(g_ref, e_ref, es_ref, packed_ref, scale_ref, new_e_ref, new_es_ref, finite_ref):
    pid = pl.program_id(0)

    def body(k, carry):
      row = pl.ds(k * programs + pid, 1)
      gs = [g_ref[row, p] for p in planes]
      q, scale, new_error, new_scale, _ = kernels._step(
          gs, [e_ref[row, p] for p in planes], es_ref[row, :], 4, 8, 0.8, ops, False)
      word = None
      for t, p in enumerate(planes):
        new_e_ref[row, p] = new_error[t].astype(jnp.int8)
        unsigned = (q[t] + 8).astype(jnp.int32) << (4 * t)
        word = unsigned if word is None else word | unsigned
      packed_ref[row, :] = word.astype(jnp.uint8)
      scale_ref[row, :] = scale
      new_es_ref[row, :] = new_scale
      finite_ref[row, :] = kernels._all_finite_rows(gs)
      return carry

    jax.lax.fori_loop(0, blocks // programs, body, 0)

  shapes = [((blocks, width), jnp.uint8), ((blocks, 1), jnp.float32),
            ((blocks, block_size), jnp.int8), ((blocks, 1), jnp.float32),
            ((blocks, 1), jnp.int32)]
  return pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct(s, t) for s, t in shapes], grid=(programs,),
      compiler_params=None if INTERPRET else pltriton.CompilerParams(num_warps=warps,
                                                                     num_stages=stages),
      interpret=INTERPRET,
  )(g, error, error_scale[:, None])


VARIANTS = [  # (layout, arithmetic, tile blocks or programs, warps, stages)
    ("grid", "ptx", 1, 2, 1), ("grid", "ptx", 1, 4, 1), ("grid", "triton", 1, 4, 1),
    ("persistent", "ptx", 512, 4, 3), ("persistent", "ptx", 1024, 4, 3),
    ("persistent", "ptx", 2048, 4, 3), ("persistent", "ptx", 1024, 4, 1),
    ("persistent", "ptx", 1024, 8, 3), ("persistent", "ptx", 4096, 4, 2),
]


def _variant_step(layout, ops, size, warps, stages):
  """(g [blocks, 2048], (error, error_scale)) -> (packed, scales, finite, new state)."""
  kernel = _compress if layout == "grid" else _persistent
  return lambda x, state: (lambda out: (out[0], out[1], out[4], (out[2], out[3][:, 0])))(
      kernel(x, *state, size, warps, stages, ops))


def _matches_jnp(step) -> bool:
  """The variant against compress_step's jnp path, bit for bit, on 8192 random blocks."""
  rng = np.random.default_rng(5)
  blocks = 8192
  g = (rng.standard_normal((blocks, 2048)) * np.exp(3 * rng.standard_normal((blocks, 1))))
  e = rng.integers(-127, 128, (blocks, 2048)).astype(np.int8)
  es = np.exp(rng.standard_normal(blocks)).astype(np.float32)
  g = jnp.asarray(g, jnp.float32)
  want = kernels.compress_step(g.reshape(-1), jnp.asarray(e.reshape(-1)), jnp.asarray(es),
                               implementation="jnp")
  packed, scales, _, (error, error_scale) = jax.jit(step)(g, (jnp.asarray(e), jnp.asarray(es)))
  return all(np.array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)) for a, b in
             zip((want.packed, want.scales, want.error, want.error_scale),
                 (packed, scales, error, error_scale)))


def timing_table(n: int, repeats: int) -> tuple[list[tuple[str, float]], dict[str, bool]]:
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
  matches = {}
  for layout, arith, size, warps, stages in VARIANTS:
    if blocks % size and layout == "persistent":
      continue
    name = f"{layout}_{arith}_{'tile' if layout == 'grid' else 'programs'}{size}_warps{warps}" \
           f"_stages{stages}"
    step = _variant_step(layout, ops[arith], size, warps, stages)
    try:
      matches[name] = _matches_jnp(step) if not INTERPRET else True
      step = jax.jit(step, donate_argnums=1)
      state = (jnp.zeros((blocks, 2048), jnp.int8), jnp.zeros(blocks, jnp.float32))
      jax.block_until_ready(step(g, state))
      state = (jnp.zeros((blocks, 2048), jnp.int8), jnp.zeros(blocks, jnp.float32))
      cands.append(bench._Candidate(name, step, state, (g,), keep=lambda out: out[3]))
    except Exception as e:  # noqa: BLE001
      print(f"probe: {name}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
  seconds = bench._time_interleaved(cands, repeats)
  return [(name, s) for name, s in seconds.items()], matches


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--n-params", type=int, default=1 << 28)
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--smoke", action="store_true", help="CPU, interpreter, small sizes")
  p.add_argument("--skip-rounding", action="store_true")
  args = p.parse_args()
  if args.smoke:
    global INTERPRET
    INTERPRET, args.n_params, args.repeats = True, 1024 * 2048, 1
  elif jax.default_backend() != "gpu":
    print(f"gpu_kernel_probe: needs a GPU, backend is {jax.default_backend()}", file=sys.stderr)
    return 2
  if not args.skip_rounding:
    size = 4 * BLOCK if INTERPRET else 1 << 22
    print(f"## Rounding against numpy float32 (elements differing of {size}; -1: failed)\n")
    print("| operation | form | differing |\n|---|---|---|")
    for op, name, count in rounding_table(size):
      print(f"| {op} | {name} | {count} |")
  n = args.n_params
  print(f"\n## Compress kernel, n = {n}, median of {args.repeats} (interleaved)\n")
  print("| variant | ms | vs adamw | GB/s at 6.5 B/elem | vs copy | equals jnp |\n"
        "|---|---|---|---|---|---|")
  timed, matches = timing_table(n, args.repeats)
  seconds = dict(timed)
  for name, s in seconds.items():
    print(f"| {name} | {s * 1e3:.3f} | {s / seconds['adamw']:.3f} | "
          f"{n * 6.5 / s / 1e9:.0f} | {seconds['copy_6.5B'] / s:.3f} | "
          f"{matches.get(name, '')} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
