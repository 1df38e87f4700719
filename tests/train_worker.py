"""Trains the 2-layer MLP regression with parallel.make_train_step; checkpoints, resumes, logs.

Usage (one process of 8 CPU devices, zero2 + LoCo, a checkpoint every 5 steps):
  python train_worker.py --steps 20 --losses L.txt --ckpt-dir D --ckpt-every 5
Several processes: add --num-processes 2 --process-id I --port P --devices-per-process 4.
--model 2: the devices as (data=N/2, model=2), the params split over "model" (MODEL_SPECS).
Appends "step loss" lines (step = updates done, loss = repr of that update's mean loss) to
--losses (process 0 only) and resumes from the newest checkpoint in --ckpt-dir if there is one;
with --elastic, also from a checkpoint of another device count (`reshard=True`).
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402  (importing jax touches no device; main() configures them first)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from loco_jax import loco  # noqa: E402
from loco_jax.train import checkpoint, fsdp, parallel

IN, OUT, BATCH = 16, 4, 64
LAYERS = 2  # mode="fsdp": residual tanh blocks between the regression's two layers
MODEL_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def init_params(hidden: int) -> dict[str, np.ndarray]:
  """The same float32 numpy params on every process."""
  rng = np.random.default_rng(0)
  return {"w1": (rng.standard_normal((IN, hidden)) * 0.3).astype(np.float32),
          "b1": np.zeros(hidden, np.float32),
          "w2": (rng.standard_normal((hidden, OUT)) * 0.3).astype(np.float32),
          "b2": np.zeros(OUT, np.float32)}


def loss_fn(params, batch_Bx20: jax.Array) -> jax.Array:
  h_BxH = jax.numpy.tanh(batch_Bx20[:, :IN] @ params["w1"] + params["b1"])
  return jax.numpy.mean((h_BxH @ params["w2"] + params["b2"] - batch_Bx20[:, IN:]) ** 2)


def layered_model() -> fsdp.LayeredModel:
  """mode="fsdp": the regression's first layer as embed, LAYERS residual blocks, its output
  layer as head."""
  tanh = jax.numpy.tanh
  return fsdp.LayeredModel(
      embed=lambda p, batch_Bx20: tanh(batch_Bx20[:, :IN] @ p["w1"] + p["b1"]),
      block=lambda p, h_BxH: h_BxH + tanh(h_BxH @ p["w"] + p["b"]),
      head=lambda p, h_BxH, batch_Bx20: jax.numpy.mean(
          (h_BxH @ p["w2"] + p["b2"] - batch_Bx20[:, IN:]) ** 2))


def layered_params(hidden: int) -> fsdp.Layered:
  """`init_params` with LAYERS blocks of [hidden, hidden] (stacked) in between."""
  params = init_params(hidden)
  w = np.random.default_rng(1).standard_normal((LAYERS, hidden, hidden)) * 0.1
  return fsdp.Layered({"w1": params["w1"], "b1": params["b1"]},
                      {"w": w.astype(np.float32), "b": np.zeros((LAYERS, hidden), np.float32)},
                      {"w2": params["w2"], "b2": params["b2"]})


def batch(step: int, mesh: Mesh) -> jax.Array:
  """Batch number `step` (0-based): numpy data from the step index alone, split over the mesh."""
  teacher = np.random.default_rng(1234).standard_normal((IN, OUT))
  x = np.random.default_rng(step).standard_normal((BATCH, IN))
  full = np.concatenate([x, np.tanh(x @ teacher)], axis=1).astype(np.float32)
  return jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("data")),
                                      lambda idx: full[idx])


def mesh_of(model: int) -> Mesh:
  """Every device as (data=N), or as (data=N/model, model=model) for model > 1."""
  if model <= 1:
    return parallel.data_mesh()
  return jax.make_mesh((jax.device_count() // model, model), ("data", "model"),
                       axis_types=(AxisType.Auto,) * 2)


def build(mode: str, hidden: int, mesh: Mesh) -> tuple[parallel.TrainState, Callable, dict]:
  """(fresh state, train step, checkpoint config) of the run: adam, LoCo as the compressor; on
  a mesh with a "model" axis the params split as MODEL_SPECS says.

  Example:
    >>> state, step, config = build("zero2", 64, parallel.data_mesh(8))
  """
  sharded = mode in ("zero2", "fsdp")
  params = layered_params(hidden) if mode == "fsdp" else init_params(hidden)
  if "model" in mesh.axis_names:
    params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in MODEL_SPECS.items()})
  optimizer = optax.adam(1e-2)
  compressor = loco(axis_name="data", scatter=sharded)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode)
  step = parallel.make_train_step(layered_model() if mode == "fsdp" else loss_fn, optimizer,
                                  mesh, params, compressor=compressor, mode=mode)
  config = {"model": "mlp-regression" + (f"-{LAYERS}-blocks" if mode == "fsdp" else ""),
            "shape": [IN, hidden, OUT], "mode": mode,
            "devices": mesh.size, "optimizer": "adam(1e-2)",
            "compressor": f"loco(axis_name='data', scatter={sharded})",
            "layout": checkpoint.train_layout(mesh, params, mode=mode)}
  return state, step, config


def _args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mode", choices=parallel.MODES, default="zero2")
  p.add_argument("--steps", type=int, default=20, help="train until this many updates are done")
  p.add_argument("--losses", type=Path, required=True, help="file to append 'step loss' lines")
  p.add_argument("--ckpt-dir", type=Path, default=None)
  p.add_argument("--ckpt-every", type=int, default=0, help="0: never checkpoint")
  p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after a step")
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--port", type=int, default=0)
  p.add_argument("--devices-per-process", type=int, default=8)
  p.add_argument("--model", type=int, default=1, help="devices of the 'model' axis (1: none)")
  p.add_argument("--elastic", action="store_true",
                 help="resume from a checkpoint of another device count too")
  p.add_argument("--heartbeat-timeout", type=int, default=100,
                 help="seconds before jax.distributed declares a silent peer dead")
  return p.parse_args()


def main() -> None:
  args = _args()
  os.environ.pop("XLA_FLAGS", None)  # the device count comes from --devices-per-process alone
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.devices_per_process)
  if args.num_processes > 1:
    parallel.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id,
                        initialization_timeout=60,
                        heartbeat_timeout_seconds=args.heartbeat_timeout)
  mesh = mesh_of(args.model)
  state, step_fn, config = build(args.mode, args.hidden, mesh)
  done = 0
  if args.ckpt_dir is not None and checkpoint.latest_step(args.ckpt_dir) is not None:
    if args.elastic:
      state, done, resharded = checkpoint.restore(args.ckpt_dir, state, config, reshard=True,
                                                  mesh_keys=("devices",))
      print(resharded or "on the same mesh", flush=True)
    else:
      state, done = checkpoint.restore(args.ckpt_dir, state, config)
    assert int(state.step) == done, (int(state.step), done)
    print(f"resumed from step {done}", flush=True)
  log = open(args.losses, "a") if args.process_id == 0 else None
  while done < args.steps:
    state, loss = step_fn(state, batch(done, mesh))
    done += 1
    if log:
      log.write(f"{done} {float(loss.addressable_data(0))!r}\n")
      log.flush()
    if args.ckpt_dir is not None and args.ckpt_every and done % args.ckpt_every == 0:
      checkpoint.save(args.ckpt_dir, done, state, config)
    time.sleep(args.step_delay)
  if log:
    log.close()
  print("done", args.process_id, flush=True)


if __name__ == "__main__":
  main()
