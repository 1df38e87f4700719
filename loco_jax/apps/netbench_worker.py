"""One netbench host: joins the job bound to its address, times each method's exchange step.

Run by netbench inside a host's namespace (`python -m loco_jax.apps.netbench_worker ...`); prints
one JSON line per method ("result": ...) and nothing else on stdout.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time

# The exchanges netbench measures: a gradient of `n` float32 parameters averaged over the hosts.
METHODS = ("fp32", "bf16", "loco", "loco-quantized", "int4", "zero2-fp32", "zero2-loco", "co3")
# End-to-end training (adamw): ddp with the gradient averaged by each, then zero2 and fsdp
# (parallel's modes, the demo GPT split into layers) reduce-scattering it in float32 or with
# LoCo. "compute" averages nothing: the ddp step without the exchange, which splits every ddp
# method's step into compute + exchange (for zero2 and fsdp the rest includes their gathers).
TRAIN_METHODS = ("fp32", "bf16", "loco", "loco-quantized", "zero2-fp32", "zero2-loco",
                 "fsdp-fp32", "fsdp-loco")
# zero2 and fsdp gather the parameters in the compute dtype, or as int8 with block scales.
PARAM_GATHERS = ("float32", "bfloat16", "int8")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="netbench_worker")
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--hosts", type=int, required=True)
  p.add_argument("--coordinator", required=True, help="ADDRESS:PORT of host 0")
  p.add_argument("--address", required=True, help="this host's address: gloo binds to it")
  p.add_argument("--interface", required=True, help="the link whose tx_bytes are counted")
  p.add_argument("--params", type=int, required=True)
  p.add_argument("--methods", required=True)
  p.add_argument("--steps", type=int, required=True)
  p.add_argument("--warmup", type=int, required=True)
  p.add_argument("--devices-per-host", type=int, default=1)
  p.add_argument("--timeout", type=int, required=True, help="seconds before this host gives up")
  p.add_argument("--namespace", required=True, help="this host's namespace (names the process)")
  p.add_argument("--train-methods", default="", help="comma-separated TRAIN_METHODS ('': none)")
  p.add_argument("--train-steps", type=int, default=0)
  p.add_argument("--train-model", default="512,1,3072,8",
                 help="the demo GPT's d_model,n_layers,d_ff,n_heads")
  p.add_argument("--batch-per-host", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--param-gather", choices=PARAM_GATHERS, default="float32")
  return p


def _tx_bytes(interface: str) -> int:
  with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
    return int(f.read())


def _exchange(method: str, n_params: int, mesh, jax, jnp, P):
  """(jitted step(grads, state) -> (averaged, state), initial state) for `method`."""
  from loco_jax import co3, loco
  from loco_jax.train import parallel, shards
  from loco_jax.transforms import baselines
  params = {"w": jnp.zeros((n_params,), jnp.float32)}
  like = {"w": jax.ShapeDtypeStruct((n_params,), jnp.float32)}
  compressors = {
      "fp32": lambda: baselines.uncompressed("data"),
      "bf16": lambda: baselines.bf16("data"),
      "loco": lambda: loco(axis_name="data"),
      "loco-quantized": lambda: loco(axis_name="data", gather="quantized"),
      "int4": lambda: baselines.int_quantized(4, axis_name="data"),
      "co3": lambda: co3(axis_name="data"),
      # ZeRO-2: the gradient's reduce-scatter, then the all-gather of the updated parameter
      # shards (float32 masters gathered in fp32, or in the bf16 compute dtype with LoCo).
      "zero2-fp32": lambda: parallel.reduce_scatter("data"),
      "zero2-loco": lambda: loco(axis_name="data", scatter=True),
  }
  comp = compressors[method]()
  state, specs = parallel.init_opt_state(comp, params, mesh)
  param_dtype = {"zero2-fp32": jnp.float32, "zero2-loco": jnp.bfloat16}.get(method)

  def local(g_1xN, s):
    out, s = comp.update({"w": g_1xN[0]}, s, params)
    if param_dtype is not None:  # the shards come back as full parameters
      out = shards.gather_params(out, like, "data", shards.ParamGather(param_dtype))
    return out, s

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), specs),
                               out_specs=({"w": P()}, specs)))
  return step, state


def train_config(args, devices: int):
  """The demo's config for netbench's training run: the GPT of --train-model on --seq-len
  windows, --batch-per-host sequences per host (split over its devices), --train-steps."""
  from loco_jax.apps import demo
  d_model, n_layers, d_ff, n_heads = (int(v) for v in args.train_model.split(","))
  per_device = args.batch_per_host * args.hosts // devices
  return demo.DemoConfig(steps=args.train_steps, devices=devices, batch_per_device=per_device,
                         seq_len=args.seq_len, d_model=d_model, n_layers=n_layers,
                         n_heads=n_heads, d_ff=d_ff, warmup=min(10, args.train_steps // 4),
                         eval_batches=8, corpus_bytes=2_000_000)


def _step_without_exchange(loss_fn, optimizer, mesh, specs, jax, P):
  """make_train_step's ddp step with nothing averaged: each host applies its own gradient (its
  params drift apart, which the timing does not mind; shard_map is told not to check)."""
  import optax
  from loco_jax.train import parallel

  def local(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return (parallel.TrainState(optax.apply_updates(state.params, updates),
                                state.compressor_state, opt_state, state.step + 1), loss)

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")),
                               out_specs=(specs, P()), check_vma=False), donate_argnums=0)
  step.jitted = step
  return step


def _sharded_model(mode: str, config):
  """(params, loss_fn for the step, eval_loss(full params, batch), unshard) of the demo GPT cut
  into embed / stacked blocks / head (`gpt.layered_model`); zero2 takes each layer as its own
  leaves (`fsdp.unstacked`), so that both modes shard and block the layers alike."""
  from flax import nnx
  from loco_jax.apps.models import GPT, GPTConfig, gpt
  from loco_jax.train import fsdp, parallel
  gpt_config = GPTConfig(seq_len=config.seq_len, d_model=config.d_model,
                         n_layers=config.n_layers, n_heads=config.n_heads, d_ff=config.d_ff)
  model = gpt.layered_model(gpt_config)
  params = gpt.layered_params(gpt.split_model(GPT(gpt_config, rngs=nnx.Rngs(config.seed)))[1])
  if mode == "zero2":
    params, loss_fn = fsdp.unstacked(params, model)
    return params, loss_fn, loss_fn, parallel.unshard_params
  return params, model, fsdp.layered_loss(model), fsdp.unshard_params


def _train(method: str, config, corpus, mesh, interface: str, jax, jnp, P,
           param_gather: str = "float32"):
  """Trains the demo GPT with `method` averaging the gradients; this host's record."""
  import numpy as np
  from jax.sharding import NamedSharding
  from loco_jax import comm, loco
  from loco_jax.apps import demo
  from loco_jax.apps.models import num_params
  from loco_jax.train import parallel
  from loco_jax.transforms import baselines
  mode, _, wire = method.rpartition("-") if method.startswith(("zero2-", "fsdp-")) else (
      "ddp", "", method)
  if mode == "ddp":
    compressor = {
        "compute": lambda: None, "fp32": lambda: baselines.uncompressed("data"),
        "bf16": lambda: baselines.bf16("data"), "loco": lambda: loco(axis_name="data"),
        "loco-quantized": lambda: loco(axis_name="data", gather="quantized")}[wire]()
    _, params, loss_fn = demo.make_model(config)
    eval_loss_fn, unshard = loss_fn, None
  else:
    compressor = {"fp32": lambda: parallel.reduce_scatter("data"),
                  "loco": lambda: loco(axis_name="data", scatter=True)}[wire]()
    params, loss_fn, eval_loss_fn, unshard = _sharded_model(mode, config)
  optimizer = demo.make_optimizer(config)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode)
  if compressor is None:
    step = _step_without_exchange(loss_fn, optimizer, mesh, specs, jax, P)
  else:
    gather = {} if mode == "ddp" else {"bfloat16": {"compute_dtype": jnp.bfloat16},
                                       "int8": {"param_gather": "int8"}}.get(param_gather, {})
    step = parallel.make_train_step(loss_fn, optimizer, mesh, specs, params,
                                    compressor=compressor, mode=mode, **gather)
  sharding = NamedSharding(mesh, P("data"))
  batches = [jax.make_array_from_callback(b.shape, sharding, lambda idx, b=b: b[idx])
             for b in corpus.train_SxBxL]
  compiled_text = step.jitted.lower(state, batches[0]).compile().as_text()
  # Per step: a collective in fsdp's scan over layers runs once per layer.
  found = comm.collectives_per_step(compiled_text, jax.device_count())
  n_params = num_params(params)
  times, warm = [], 2
  tx0 = None
  for i, batch in enumerate(batches):
    if i == warm:
      tx0 = _tx_bytes(interface)
    t0 = time.perf_counter()
    state, loss = step(state, batch)
    loss = float(np.asarray(loss.addressable_data(0)))
    times.append(time.perf_counter() - t0)
  sent = _tx_bytes(interface) - tx0
  timed = len(batches) - warm
  replay = collectives_only(found, mesh, jax, jnp, P)
  n_dev = mesh.shape["data"]
  ones = jax.make_array_from_callback((n_dev,), NamedSharding(mesh, P("data")),
                                      lambda idx: np.ones(n_dev, np.float32)[idx])
  jax.block_until_ready(replay(ones))
  collectives_s = _median_time(replay, ones, steps=5, jax=jax)
  if unshard is None:
    local = jax.tree.map(lambda x: x.addressable_data(0), state.params)
  else:  # the shards of every host, gathered, then put back into the model's shapes
    gathered = jax.jit(lambda s: s, out_shardings=NamedSharding(mesh, P()))(state.params)
    local = unshard(jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), gathered),
                    params)
  eval_fn = jax.jit(eval_loss_fn)
  eval_loss = float(np.mean([float(eval_fn(local, b)) for b in corpus.eval_KxBxL]))
  return {"method": method, "step_s": statistics.median(times), "final_loss": loss,
          "collectives_s": collectives_s,
          "eval_loss": eval_loss, "n_params": n_params,
          "tokens_per_step": int(corpus.train_SxBxL.shape[1] * config.seq_len),
          "measured_bits_per_param": 8 * sent / (timed * n_params),
          "predicted_bits_per_param": comm.wire_bits_per_param(found, n_params),
          # Async collectives with compute scheduled between start and done (overlap).
          "overlapped_collectives": sum(comm.async_collectives(compiled_text).values())}


_DTYPES = {"u8": "uint8", "s8": "int8", "u16": "uint16", "s16": "int16", "bf16": "uint16",
           "f16": "uint16", "u32": "uint32", "s32": "int32", "f32": "float32"}


def collectives_only(found, mesh, jax, jnp, P):
  """A jitted program that runs just the collectives of `found` (each piece as compiled: op,
  dtype, bytes) on zeros, in order: the exchange's wire time without the step's compute."""
  n = mesh.shape["data"]

  def local(x):
    out = []
    for c in (c for c in found if not c.conditional):
      dtype = jnp.dtype(_DTYPES.get(c.dtype, "uint8"))
      count = max(int(c.nbytes // (dtype.itemsize if c.dtype in _DTYPES else 1)), n)
      count -= count % n
      zeros = jnp.zeros((count,), dtype) + x[0].astype(dtype)   # not a constant: runs each step
      if c.op == "all-reduce":
        out.append(jax.lax.psum(zeros, "data")[:1])
      elif c.op == "all-to-all":
        out.append(jax.lax.all_to_all(zeros.reshape(n, -1), "data", 0, 0, tiled=True)[0, :1])
      elif c.op == "all-gather":
        out.append(jax.lax.all_gather(zeros[: count // n], "data", tiled=True,
                                      to="invarying")[:1])
      elif c.op == "reduce-scatter":
        out.append(jax.lax.psum_scatter(zeros, "data", tiled=True)[:1])
      else:
        out.append(jax.lax.ppermute(zeros[: count // n], "data",
                                    [(i, (i + 1) % n) for i in range(n)])[:1])
      x = x + out[-1][:1].astype(x.dtype) * 0   # keeps the order: each waits for the last
    return x

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                               check_vma=False))


def _median_time(fn, *args, steps: int, jax) -> float:
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  # A hung peer must fail this host, not hang it: the whole run is bounded (default: exit).
  signal.alarm(args.timeout)
  print(f"netbench host {args.process_id} in {args.namespace} at {args.address}", file=sys.stderr)
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices_per_host)
  from loco_jax import comm
  from loco_jax.train import parallel
  parallel.initialize(args.coordinator, args.hosts, args.process_id,
                      gloo_hostname=args.address, initialization_timeout=min(args.timeout, 120),
                      heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = parallel.data_mesh()
  n_dev = jax.device_count()
  barrier = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                                  in_specs=P("data"), out_specs=P()))
  ones = jax.make_array_from_callback((n_dev,), NamedSharding(mesh, P("data")),
                                      lambda idx: np.ones(n_dev, np.float32)[idx])
  rng = np.random.default_rng(args.process_id)
  grads = jax.make_array_from_callback(
      (n_dev, args.params), NamedSharding(mesh, P("data")),
      lambda idx: rng.standard_normal((1, args.params)).astype(np.float32)
      * (np.arange(args.params, dtype=np.float32) % 7 + 1) * 1e-3)

  for method in args.methods.split(","):
    step, state = _exchange(method, args.params, mesh, jax, jnp, P)
    found = comm.compiled_collectives(step, grads, state, num_devices=n_dev)
    predicted = comm.wire_bits_per_param(found, args.params) * args.devices_per_host
    for _ in range(args.warmup):
      out, state = step(grads, state)
      jax.block_until_ready(out)
    # Every host has finished the warm-up once the barrier returns on all of them.
    jax.block_until_ready(barrier(ones))
    tx0, times, cpu = _tx_bytes(args.interface), [], []
    for _ in range(args.steps):
      t0, c0 = time.perf_counter(), time.process_time()
      out, state = step(grads, state)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t0)
      cpu.append(time.process_time() - c0)
    jax.block_until_ready(barrier(ones))  # the peers have received all this host sent
    sent = _tx_bytes(args.interface) - tx0
    # Where the step's time goes: its collectives alone, as compiled (same pieces, same bytes).
    replay = collectives_only(found, mesh, jax, jnp, P)
    jax.block_until_ready(replay(ones))
    jax.block_until_ready(barrier(ones))
    collectives_s = _median_time(replay, ones, steps=args.steps, jax=jax)
    finite = bool(np.isfinite(np.asarray(out["w"].addressable_data(0))).all())
    print(json.dumps({"result": {
        "method": method, "host": args.process_id, "step_s": statistics.median(times),
        "cpu_s": statistics.median(cpu), "sent_bytes": sent, "collectives_s": collectives_s,
        "measured_bits_per_param": 8 * sent / (args.steps * args.params),
        "predicted_bits_per_param": predicted, "finite": finite,
        "malloc": os.environ.get("GLIBC_TUNABLES", ""),
        "collectives": [f"{c.op}:{c.dtype}:{int(c.nbytes)}" + (":cond" if c.conditional else "")
                        for c in found]}}), flush=True)
  if args.train_steps:
    from loco_jax.apps import demo
    config = train_config(args, n_dev)
    corpus = demo.load_corpus(config)
    # "compute" first: the step without the exchange, for every method's split.
    for method in ["compute", *[m for m in args.train_methods.split(",") if m]]:
      jax.block_until_ready(barrier(ones))
      record = _train(method, config, corpus, mesh, args.interface, jax, jnp, P,
                      args.param_gather)
      print(json.dumps({"train": {**record, "host": args.process_id}}), flush=True)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
