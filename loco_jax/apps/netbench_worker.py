"""One netbench host: joins the job bound to its address, times each method's exchange step.

Run by netbench inside a host's namespace (`python -m loco_jax.apps.netbench_worker ...`); prints
one JSON line per method ("result": ...) and nothing else on stdout. On two levels the host
given `--uplinks` also reads the inter-node links' counters around the timed steps.
"""

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

from loco_jax.apps import netbench_methods, netbench_profile, netns
from loco_jax.apps import sent as counters

# A task whose heartbeats stop this long fails the job: 30 s failed a run on busy cores
# (a two-level run). A host that dies is seen at once by netbench (its exit), one that hangs by
# --timeout.
HEARTBEAT_TIMEOUT_S = 120
# The median holds at least this many seconds of steps: at 2 hosts and 1 Gb/s, 5 steps of
# about 60 ms put loco's median 19% over that of 15 on the same hosts.
MIN_TIMED_S = 1.0
MAX_TIMED_STEPS = 60

# End-to-end training (adamw): ddp with the gradient averaged by each, then zero2 and fsdp
# (parallel's modes, the demo GPT split into layers) reduce-scattering it in float32 or with
# LoCo. "compute" averages nothing: the ddp step without the exchange, which splits every ddp
# method's step into compute + exchange (for zero2 and fsdp the rest includes their gathers).
# The diloco methods (mode="diloco") average the pseudo-gradients every --inner-steps steps in
# float32 or with LoCo; their step time is the mean over whole rounds, syncs included. Their
# -overlap forms run each sync on a second device of the host beside the next --overlap inner
# steps.
DILOCO_METHODS = ("diloco", "diloco-loco", "diloco-loco-quantized")
TRAIN_METHODS = ("fp32", "bf16", "loco", "loco-quantized", "zero2-fp32", "zero2-loco",
                 "fsdp-fp32", "fsdp-loco", *DILOCO_METHODS,
                 *(f"{m}-overlap" for m in DILOCO_METHODS))
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
  p.add_argument("--nodes", type=int, default=1, help="nodes of --hosts / --nodes hosts each")
  p.add_argument("--profile", type=int, default=0,
                 help="steps traced after the timed ones, their thunks summed by kind (0: none)")
  p.add_argument("--cpu", type=int, default=None,
                 help="the one CPU core this host runs on, set before jax starts (default: all)")
  p.add_argument("--uplinks", default="",
                 help="NAMESPACE:INTERFACE of each node's inter-node link, whose tx_bytes this "
                      "host reads around the timed steps ('': none)")
  p.add_argument("--train-methods", default="", help="comma-separated TRAIN_METHODS ('': none)")
  p.add_argument("--train-steps", type=int, default=0)
  p.add_argument("--train-model", default="512,1,3072,8",
                 help="the demo GPT's d_model,n_layers,d_ff,n_heads")
  p.add_argument("--batch-per-host", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--param-gather", choices=PARAM_GATHERS, default="float32")
  p.add_argument("--inner-steps", type=int, default=32, help="the diloco methods' H")
  p.add_argument("--fragments", type=int, default=1, help="the diloco methods' F")
  p.add_argument("--overlap", type=int, default=0,
                 help="the -overlap methods' tau (0: none of them runs); each host then has "
                      "twice --devices-per-host devices, the second half for the syncs")
  return p


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


def _train_options(method: str, outer: dict) -> tuple[str, Any, dict]:
  """(mode, compressor, DiLoCo's options) of a training method; `outer`: DiLoCo's inner_steps,
  fragments and overlap (taken by the -overlap methods only)."""
  from loco_jax import loco
  from loco_jax.train import parallel
  from loco_jax.transforms import baselines
  if method.startswith("diloco"):
    base = method.removesuffix("-overlap")
    compressor = {"diloco": None, "diloco-loco": loco(axis_name="data"),
                  "diloco-loco-quantized": loco(axis_name="data", gather="quantized")}[base]
    return "diloco", compressor, {**outer, "overlap": outer["overlap"] if base != method else 0}
  mode, _, wire = method.rpartition("-") if method.startswith(("zero2-", "fsdp-")) else (
      "ddp", "", method)
  if mode == "ddp":
    return mode, {
        "compute": lambda: None, "fp32": lambda: baselines.uncompressed("data"),
        "bf16": lambda: baselines.bf16("data"), "loco": lambda: loco(axis_name="data"),
        "loco-quantized": lambda: loco(axis_name="data", gather="quantized")}[wire](), {}
  return mode, {"fp32": lambda: parallel.reduce_scatter("data"),
                "loco": lambda: loco(axis_name="data", scatter=True)}[wire](), {}


def _train(method: str, config, corpus, mesh, interface: str, jax, jnp, P,
           param_gather: str = "float32", outer: dict | None = None):
  """Trains the demo GPT with `method` averaging the gradients; this host's record. `outer`:
  the diloco methods' inner_steps, fragments and overlap."""
  import numpy as np
  from jax.sharding import NamedSharding
  from loco_jax import comm
  from loco_jax.apps import demo
  from loco_jax.apps.models import num_params
  from loco_jax.train import parallel
  mode, compressor, outer = _train_options(
      method, outer or {"inner_steps": 32, "fragments": 1, "overlap": 0})
  if mode in ("ddp", "diloco"):
    _, params, loss_fn = demo.make_model(config)
    eval_loss_fn, unshard = loss_fn, None
  else:
    params, loss_fn, eval_loss_fn, unshard = _sharded_model(mode, config)
  optimizer = demo.make_optimizer(config)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode, **outer)
  if method == "compute":
    step = _step_without_exchange(loss_fn, optimizer, mesh, specs, jax, P)
  else:
    gather = {} if mode == "ddp" else {"bfloat16": {"compute_dtype": jnp.bfloat16},
                                       "int8": {"param_gather": "int8"}}.get(param_gather, {})
    step = parallel.make_train_step(loss_fn, optimizer, mesh, params,
                                    compressor=compressor, mode=mode, **gather, **outer)
  sharding = NamedSharding(mesh, P("data"))
  batches = [jax.make_array_from_callback(b.shape, sharding, lambda idx, b=b: b[idx])
             for b in corpus.train_SxBxL]
  # Per step: a collective in fsdp's scan over layers runs once per layer. DiLoCo: each program
  # in its share of the steps.
  programs = []
  for lowered, share in demo.lowered_programs(step, mode, state, batches[0]):
    text = lowered.compile().as_text()
    programs.append((text, comm.collectives_per_step(text, mesh.size), share))
  n_params = num_params(params)
  # DiLoCo: its first round compiles the inner step and the sync, and is not timed; whole
  # rounds are. With overlap they start after the first merge (which compiles it) and end with
  # a merge: no sync runs across either end (while tau is below a fragment's spacing).
  times, warm = [], 2
  if mode == "diloco":
    warm = outer["inner_steps"] + outer["overlap"]
    batches = batches[:warm + (len(batches) - warm) // outer["inner_steps"]
                      * outer["inner_steps"]]
  start = None
  for i, batch in enumerate(batches):
    if i == warm:   # a sync still running (tau at or past a fragment's spacing) ends first ...
      jax.block_until_ready(state)
      start = counters.read(interface)
    t0 = time.perf_counter()
    state, loss = step(state, batch)
    loss = float(np.asarray(loss.addressable_data(0)))
    if i == len(batches) - 1:   # ... and one they start is counted whole, in the last step
      jax.block_until_ready(state)
    times.append(time.perf_counter() - t0)
  sent = counters.read(interface).since(start)
  timed = len(batches) - warm
  ones = _ones(mesh, jax)
  collectives_s = 0.0
  for _, found, share in programs:
    if found:
      replay = netbench_methods.collectives_replay(found, mesh)
      jax.block_until_ready(replay(ones))
      collectives_s += share * _median_times(replay, ones, steps=5, jax=jax)[0]
  if unshard is None:
    local = jax.tree.map(lambda x: x.addressable_data(0), state.params)
  else:  # the shards of every host, gathered, then put back into the model's shapes
    gathered = jax.jit(lambda s: s, out_shardings=NamedSharding(mesh, P()))(state.params)
    local = unshard(jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), gathered),
                    params)
  eval_fn = jax.jit(eval_loss_fn)
  eval_loss = float(np.mean([float(eval_fn(local, b)) for b in corpus.eval_KxBxL]))
  # A DiLoCo step's time is the mean over its whole rounds.
  step_s = (statistics.fmean(times[warm:]) if mode == "diloco" else statistics.median(times))
  return {"method": method, "step_s": step_s, "final_loss": loss,
          **(_diloco_steps(times, warm, outer) if mode == "diloco" else {}),
          "collectives_s": collectives_s,
          "eval_loss": eval_loss, "n_params": n_params,
          "tokens_per_step": int(corpus.train_SxBxL.shape[1] * config.seq_len),
          "sent": sent._asdict(),
          "measured_bits_per_param": 8 * sent.interface_bytes / (timed * n_params),
          "payload_bits_per_param": 8 * sent.payload_bytes / (timed * n_params),
          "predicted_bits_per_param": sum(share * comm.wire_bits_per_param(found, n_params)
                                          for _, found, share in programs),
          # Async collectives with compute scheduled between start and done (overlap).
          "overlapped_collectives": sum(sum(comm.async_collectives(text).values())
                                        for text, _, _ in programs)}


def _diloco_steps(times: list[float], warm: int, outer: dict) -> dict:
  """A DiLoCo run's timed steps by kind: `inner_s` the median of the steps that neither start
  a sync nor merge one (the inner step alone), `sync_step_s` the mean of those that start one
  (without overlap: the inner step and the whole sync), `merge_step_s` that of those that merge
  one (with overlap: what is left of the sync to wait for); None where no step is of a kind."""
  from loco_jax.train import diloco
  h, f, tau = outer["inner_steps"], outer["fragments"], outer["overlap"]
  kinds = {"inner_s": [], "sync_step_s": [], "merge_step_s": []}
  for k in range(warm, len(times)):
    syncs = diloco.sync_fragment(k, h, f) is not None
    merges = diloco.merge_fragment(k, h, f, tau) is not None
    kinds["sync_step_s" if syncs else "merge_step_s" if merges else "inner_s"].append(times[k])
  middle = {"inner_s": statistics.median, "sync_step_s": statistics.fmean,
            "merge_step_s": statistics.fmean}
  return {**{k: middle[k](v) if v else None for k, v in kinds.items()},   # None: no such step
          "overlap": tau, "fragments": f, "inner_steps": h}


def _median_times(fn, *args, steps: int, jax) -> tuple[float, float]:
  """`fn(*args)`'s median wall time and median process CPU time (every thread of this host)."""
  times, cpu = [], []
  for _ in range(steps):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return statistics.median(times), statistics.median(cpu)


def _compute_mesh(args, jax):
  """The 1-D "data" mesh of every host's first --devices-per-host devices (of all of them
  without --overlap; with it the rest run the syncs)."""
  import numpy as np
  from jax.sharding import AxisType, Mesh
  devices = [d for p in range(args.hosts) for d in sorted(
      (d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[
          :args.devices_per_host]]
  return Mesh(np.array(devices), ("data",), axis_types=(AxisType.Auto,))


def _meshes(args, jax) -> dict:
  """{"flat": the 1-D "data" mesh of the compute devices, "nodes": the (node, local) mesh
  where --nodes > 1}, whose row k holds exactly the devices of node k's hosts."""
  from loco_jax.train import parallel
  meshes = {"flat": _compute_mesh(args, jax)}
  if args.nodes > 1:
    mesh = parallel.node_mesh(args.nodes, jax.device_count() // args.nodes)
    for k, row in enumerate(mesh.devices):
      processes = [d.process_index for d in row]
      if {p // (args.hosts // args.nodes) for p in processes} != {k}:
        raise RuntimeError(f"the (node, local) mesh's row {k} holds the devices of processes "
                           f"{processes}, not those of node {k}")
    meshes["nodes"] = mesh
  return meshes


def gradient(row: int, n_params: int):
  """Device `row`'s gradient: the same on every mesh, different on every device."""
  import numpy as np
  rng = np.random.default_rng(row)
  return (rng.standard_normal((1, n_params)).astype(np.float32)
          * (np.arange(n_params, dtype=np.float32) % 7 + 1) * 1e-3)


def _ones(mesh, jax, value: float = 1.0):
  """float32 `value`s, one a device of `mesh`, built from each host's own share."""
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  return jax.make_array_from_callback(
      (mesh.size,), NamedSharding(mesh, P(netbench_methods.mesh_axes(mesh))),
      lambda idx: np.full(mesh.size, value, np.float32)[idx])


def timed_steps(least: int, step_s: float) -> int:
  """Steps to time: at least `least`, and enough for MIN_TIMED_S (at most MAX_TIMED_STEPS).

  Example:
    >>> timed_steps(5, 2.0), timed_steps(5, 0.06), timed_steps(5, 1e-4)
    (5, 17, 60)
  """
  return max(least, min(MAX_TIMED_STEPS, math.ceil(MIN_TIMED_S / max(step_s, 1e-9))))


def _uplinks_sent(uplinks: list[tuple[str, str]]) -> list[int]:
  return [netns.link_bytes(namespace, interface)[0] for namespace, interface in uplinks]


def _host_values(state, names: tuple[str, ...]) -> dict[str, list[float]]:
  """Each named state field's values on this host's devices (netbench_methods.state_field)."""
  import numpy as np
  values = {}
  for name in names:
    x = netbench_methods.state_field(state, name)
    shards = x.addressable_shards[:1] if x.is_fully_replicated else x.addressable_shards
    values[name] = np.concatenate([np.asarray(s.data).ravel() for s in shards]).tolist()
  return values


def _measure(method: str, args, mesh, barrier, ones, uplinks: list[tuple[str, str]]) -> dict:
  """This host's record of `method`'s exchange on `mesh`: its median step and CPU time, the
  bytes it sent (its interface's, and the TCP payload among them; with `uplinks`, every
  node's bytes to the others) over the timed steps, the compiled program's prediction of
  both, the step's collectives alone, and the method's state counts over the timed steps and
  gauges after them."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from loco_jax import comm
  axes = netbench_methods.mesh_axes(mesh)
  grads = jax.make_array_from_callback((mesh.size, args.params), NamedSharding(mesh, P(axes)),
                                       lambda idx: gradient(idx[0].start or 0, args.params))
  step, state = netbench_methods.exchange_step(method, args.params, mesh)
  compiled_text = step.lower(grads, state).compile().as_text()
  found = comm.collectives_per_step(compiled_text, mesh.size)   # comm.compiled_collectives
  node_of = [d.process_index // (args.hosts // args.nodes) for d in mesh.devices.flat]
  inter = netbench_methods.node_sent_bytes(found, node_of) if args.nodes > 1 else None
  out = None

  def run_step():
    nonlocal out, state
    out, state = step(grads, state)
    return out

  warm_s = 0.0
  for _ in range(args.warmup):
    t0 = time.perf_counter()
    jax.block_until_ready(run_step())
    warm_s = time.perf_counter() - t0
  # Every host times as many steps, the mean of their counts (each from its last warm-up
  # step: the first compiles); reading the sum waits for every host's warm-up.
  mine = timed_steps(args.steps, warm_s) if args.warmup > 1 else args.steps
  n_steps = round(float(np.asarray(barrier(_ones(mesh, jax, mine)).addressable_data(0))[0])
                  / mesh.size)
  uplinks0 = _uplinks_sent(uplinks)
  jax.block_until_ready(barrier(ones))   # ... and the uplinks' counters are read
  table = netbench_methods.METHODS[method]
  counts0 = _host_values(state, table.counts)
  start = counters.read(args.interface)
  step_s, cpu_s = _median_times(run_step, steps=n_steps, jax=jax)
  jax.block_until_ready(barrier(ones))  # the peers have received all this host sent
  sent = counters.read(args.interface).since(start)
  uplinks_sent = [b - a for a, b in zip(uplinks0, _uplinks_sent(uplinks))]
  counts = {name: int(sum(after) - sum(before)) for (name, before), after in
            zip(counts0.items(), _host_values(state, table.counts).values())}
  profiled = None
  if args.profile:   # every host runs the same steps: they hold collectives
    with tempfile.TemporaryDirectory(prefix="netbench-profile-") as folder:
      profiled = netbench_profile.profile(lambda: jax.block_until_ready(run_step()),
                                          compiled_text, args.profile, folder)
    jax.block_until_ready(barrier(ones))
  # Where the step's time goes: its collectives alone, as compiled (same pieces, same bytes).
  replay = netbench_methods.collectives_replay(found, mesh)
  replay_ones = _ones(mesh, jax)
  jax.block_until_ready(replay(replay_ones))
  jax.block_until_ready(barrier(ones))
  collectives_s, collectives_cpu_s = _median_times(replay, replay_ones, steps=n_steps, jax=jax)
  per_step = n_steps * args.params
  return {
      "method": method, "topology": table.topology, "steps": n_steps,
      # What ran: the step's collectives in order, the conditional ones left out.
      "exchange": " + ".join(dict.fromkeys(c.op for c in found if not c.conditional)),
      "counts": counts, "gauges": _host_values(state, table.gauges), "profile": profiled,
      "conditional_steps": counts.get(table.conditional_count, 0),
      "extension_steps": counts.get(table.extension_count, 0),
      "step_s": step_s, "cpu_s": cpu_s, "sent": sent._asdict(),
      "collectives_s": collectives_s, "collectives_cpu_s": collectives_cpu_s,
      "measured_bits_per_param": 8 * sent.interface_bytes / per_step,
      "payload_bits_per_param": 8 * sent.payload_bytes / per_step,
      "predicted_bits_per_param": comm.wire_bits_per_param(found, args.params)
                                  * args.devices_per_host,
      # A step that runs the conditional collectives (table.conditional_count) sends this more.
      "conditional_bits_per_param": (comm.wire_bits_per_param(found, args.params, True)
                                     - comm.wire_bits_per_param(found, args.params))
                                    * args.devices_per_host,
      # Of those, the coded slots' extensions: all a step that took them alone sends more.
      "extension_bits_per_param": comm.wire_bits_per_param(
          [c for c in found if comm.coded.is_extension(c)], args.params, True)
                                  * args.devices_per_host,
      "measured_inter_bits_per_node": [8 * b / per_step for b in uplinks_sent] or None,
      "predicted_inter_bits_per_node": None if inter is None else [8 * b / args.params
                                                                   for b in inter],
      "finite": bool(np.isfinite(np.asarray(out["w"].addressable_data(0))).all()),
      "malloc": os.environ.get("GLIBC_TUNABLES", ""),
      "cpus": sorted(os.sched_getaffinity(0)),
      "collectives": [_describe(c, mesh, node_of if args.nodes > 1 else None) for c in found]}


def _describe(c, mesh, node_of: list[int] | None) -> str:
  """'op:dtype:bytes:axes', then ':between=B' (bytes all nodes send the others) on two levels,
  ':cond' for a collective in a conditional branch."""
  text = f"{c.op}:{c.dtype}:{int(c.nbytes)}:{'+'.join(netbench_methods.group_axes(mesh, c.groups))}"
  if node_of is not None:
    between = netbench_methods.crossing_bytes(c, node_of)
    text += f":between={'?' if between is None else int(sum(between))}"
  return text + (":cond" if c.conditional else "")


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  # A hung peer must fail this host, not hang it: the whole run is bounded (default: exit).
  signal.alarm(args.timeout)
  print(f"netbench host {args.process_id} in {args.namespace} at {args.address}", file=sys.stderr)
  if args.cpu is not None:  # before XLA:CPU sizes its thread pool by the cores it may use
    os.sched_setaffinity(0, {args.cpu})
  import jax
  # --overlap: a second device for each, where the -overlap methods' syncs run.
  jax.config.update("jax_num_cpu_devices", args.devices_per_host * (2 if args.overlap else 1))
  from loco_jax.train import parallel
  parallel.initialize(args.coordinator, args.hosts, args.process_id,
                      gloo_hostname=args.address, initialization_timeout=min(args.timeout, 120),
                      heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                      shutdown_timeout_seconds=30)
  from jax.sharding import PartitionSpec as P

  meshes = _meshes(args, jax)
  mesh = meshes["flat"]
  barrier = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                                  in_specs=P("data"), out_specs=P()))
  ones = _ones(mesh, jax)
  uplinks = [tuple(u.split(":")) for u in args.uplinks.split(",") if u]
  for method in args.methods.split(","):
    record = _measure(method, args, meshes[netbench_methods.METHODS[method].topology], barrier,
                      ones, uplinks)
    print(json.dumps({"result": {**record, "host": args.process_id}}), flush=True)
  if args.train_steps:
    from loco_jax.apps import demo
    config = train_config(args, mesh.size)
    corpus = demo.load_corpus(config)
    # "compute" first: the step without the exchange, for every method's split.
    for method in ["compute", *[m for m in args.train_methods.split(",") if m]]:
      jax.block_until_ready(barrier(ones))
      record = _train(method, config, corpus, mesh, args.interface, jax, jax.numpy, P,
                      args.param_gather, {"inner_steps": args.inner_steps,
                                          "fragments": args.fragments, "overlap": args.overlap})
      print(json.dumps({"train": {**record, "host": args.process_id}}), flush=True)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
