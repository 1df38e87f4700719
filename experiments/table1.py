"""The LoCo paper's Table I, measured: bits on the wire and state memory per method.

  python experiments/table1.py [--d-model 128 --layers 2 --devices 8] [--out runs/table1.md]

For each method the demo's train step (the GPT of loco_jax.apps.demo, adamw) is built and lowered,
not run: b_g is the gradient collective's buffer (codes and scales) and b_w the second
collective's (the gathered averaged gradient in DDP, the gathered parameters in ZeRO-2), both
in bits per parameter; "sent" is what each device sends per parameter and step over every
collective (ring all-reduce 2(N-1)/N b, others (N-1)/N b). Memory is measured from the
initialized TrainState: bytes per parameter on one device for the parameters, the optimizer
state (adamw) and the compressor's state (errors, estimates, scales).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import common

_SCALAR_BYTES = 64


class Row(NamedTuple):
  name: str
  paper: str                 # the method of the paper's Table I it stands for
  mode: str                  # ddp | zero2
  make: Callable             # config -> compressor
  step_kwargs: dict = {}


def rows() -> list[Row]:
  import jax.numpy as jnp
  from loco_jax import loco
  from loco_jax.train import parallel
  v = common.make_variant
  bf16 = {"compute_dtype": jnp.bfloat16}
  out = [
      Row("none", "Adam (fp32 all-reduce)", "ddp", lambda c: v("none", c)),
      Row("bf16", "Adam, 16-bit gradients", "ddp", lambda c: v("bf16", c)),
      Row("int4-noef", "Zero++ qgZ (no feedback)", "ddp", lambda c: v("int4-noef", c)),
      Row("ef4", "EF (modified, fp32 error)", "ddp", lambda c: v("ef4", c)),
      Row("ef21-4", "EF21 (modified)", "ddp", lambda c: v("ef21-4", c)),
      Row("sign", "1-bit Adam's compressor", "ddp", lambda c: v("sign", c)),
      Row("topk1", "top-k 1% with EF", "ddp", lambda c: v("topk1", c)),
      Row("loco4", "LoCo", "ddp", lambda c: v("loco4", c)),
      Row("loco4-q", "LoCo, 4-bit gather", "ddp", lambda c: v("loco4-q", c)),
      Row("zero2 fp32 reduce-scatter", "Zero-2 Adam", "zero2",
          lambda c: parallel.reduce_scatter("data"), bf16),
      Row("zero2 loco4", "LoCo + Zero-2", "zero2",
          lambda c: loco(bits=4, block_size=c.block_size, axis_name="data", scatter=True), bf16),
      Row("zero2 loco4 + int8 params", "LoCo + Zero++ qwZ", "zero2",
          lambda c: loco(bits=4, block_size=c.block_size, axis_name="data", scatter=True),
          dict(bf16, param_gather="int8")),
  ]
  if common.co3_available():
    out.insert(9, Row("co3-fp4", "CO3 (fp4 + Huffman, fixed capacity)", "ddp",
                      lambda c: v("co3-fp4", c)))
  return out


def measure(row: Row, config) -> dict:
  import jax.numpy as jnp
  from loco_jax import comm
  from loco_jax.apps import demo
  from loco_jax.train import parallel
  from loco_jax.apps.models import num_params

  mesh = parallel.data_mesh(config.devices, "data")
  _, params, loss_fn = demo.make_model(config)
  n_params = num_params(params)
  optimizer = demo.make_optimizer(config)
  compressor = row.make(config)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=row.mode)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params,
                                  compressor=compressor, mode=row.mode, **row.step_kwargs)
  batch = jnp.zeros((config.global_batch, config.seq_len + 1), jnp.int32)
  text = step.jitted.lower(state, batch).as_text(dialect="hlo")
  found = [c for c in comm.collectives(text, config.devices) if c.nbytes > _SCALAR_BYTES]
  b_g = demo.gradient_bits(found, n_params)
  gradient = demo.gradient_collectives(found)
  # A conditional collective (CO3's overflow gather) runs only on rare steps: listed apart.
  rest = [c for c in found if all(c is not g for g in gradient)]
  b_w = 8.0 * sum(c.nbytes for c in rest if not c.conditional) / n_params
  per_param = lambda tree: demo.per_device_bytes(tree) / n_params
  return {
      "method": row.name, "stands for": row.paper, "mode": row.mode,
      "collectives": ", ".join(sorted({f"{c.op} {c.dtype}" + (" (conditional)" if c.conditional
                                                                else "") for c in found})),
      "b_g": b_g, "b_w": b_w,
      "sent": comm.wire_bits_per_param(comm.collectives(text, config.devices), n_params),
      "params B/p": per_param(state.params), "optimizer B/p": per_param(state.opt_state),
      "compressor B/p": per_param(state.compressor_state), "n_params": n_params,
  }


def markdown(records: list[dict], config) -> str:
  lines = [f"Measured on {common.describe(config)} ({records[0]['n_params']:,} parameters), "
           f"N = {config.devices}; B/p = bytes per parameter on one device.", "",
           "| method | stands for | mode | collectives | b_g | b_w | sent bits/param/step | "
           "params B/p | optimizer B/p | compressor B/p |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    lines.append(f"| {r['method']} | {r['stands for']} | {r['mode']} | {r['collectives']} | "
                 f"{r['b_g']:.2f} | {r['b_w']:.2f} | {r['sent']:.2f} | {r['params B/p']:.2f} | "
                 f"{r['optimizer B/p']:.2f} | {r['compressor B/p']:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--platform", default="cpu")
  p.add_argument("--out", default="runs/table1.md")
  args = p.parse_args(argv)
  common.setup(args.devices, args.platform)
  from loco_jax.apps import demo
  config = demo.DemoConfig(d_model=args.d_model, d_ff=4 * args.d_model, n_layers=args.layers,
                           devices=args.devices)
  records = []
  for row in rows():
    records.append(measure(row, config))
    print(f"{row.name}: sent {records[-1]['sent']:.2f} bits", file=sys.stderr, flush=True)
  text = markdown(records, config)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  common.write_text_atomic(out, text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
