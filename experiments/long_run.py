"""Long runs (issue 27): one method trained for 10,000 steps with warm-up and cosine decay,
evaluated every 250 steps, resumable after any kill.

  python experiments/long_run.py run --method loco4 --seed 0 --out runs/long
  python experiments/long_run.py campaign --out runs/long   # CAMPAIGN; start it once per worker
  python experiments/long_run.py time --methods none,loco4 --timing-steps 30  # step times
  python experiments/long_run_report.py runs/long                       # tables and plots

A run is a byte-level GPT (the demo's model) trained data-parallel on 8 simulated CPU devices
through the library's train step (`parallel.init_train_state` / `make_train_step`), with adamw
on `optax.warmup_cosine_decay_schedule` (linear warm-up, then cosine decay to a tenth of the
peak). Method names are the demo's (`none`, `bf16`, `loco4`, `ef4`, `loco3`, `loco2`,
`co3-fp4`, ...), a LoCo one optionally with `-r<N>`: its error reset every N steps (`-r0`:
never; default 1024, loco's).

A run lives in OUT/<method>-s<seed>/: config.json; records.jsonl, one record per evaluation
(the eval loss, the train loss of every step since the previous one, the learning rate, the
compressor's error norm and error scales, wall time), the whole file replaced atomically at
each evaluation; checkpoints/, `loco_jax.train.checkpoint` of the whole TrainState (params,
adamw state and its count, every device's LoCo error and its count) every --checkpoint-every
steps, the newest two kept. The same command continues a run from its newest checkpoint and
drops the records after it, which it then measures again: the batch of step i depends on
(seed, i) only, so the resumed curve is the uninterrupted one. Given another --devices (and
--batch-per-device keeping devices * batch_per_device, the global batch and so the data order),
it continues on that many: the checkpoint is re-laid for them (`checkpoint.restore(reshard=True)`,
every device's LoCo error the mean of the old ones) and the segment's first record says how.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

import common

AXIS = "data"
# The demo's methods but loco4-fixed (its fixed error scale is not in the state: `error_stats`).
BASE_METHODS = ("none", "bf16", "int4-noef", "ef2", "ef3", "ef4", "loco2", "loco3", "loco4",
                "co3-fp4", "diloco", "diloco-loco4", "diloco-loco4-quantized", "diloco-overlap",
                "diloco-loco4-overlap", "diloco-loco4-quantized-overlap")
# The campaign of issue 27, in the order the workers take them: the two-seed pairs first, co3-fp4
# (the slowest, docs/results/training.md "Long runs") early enough to run beside the others; ef3 and
# ef2 last, the error feedback that loco3 and loco2 are held against.
CAMPAIGN = (("none", 0), ("loco4", 0), ("none", 1), ("loco4", 1), ("loco4-r256", 0),
            ("co3-fp4", 0), ("loco4-r0", 0), ("ef4", 0), ("loco3", 0), ("loco2", 0), ("bf16", 0),
            ("ef3", 0), ("ef2", 0))
DEFAULT_RESET = 1024  # loco's default reset_interval


@dataclasses.dataclass(frozen=True)
class LongRunConfig:
  """Everything that fixes a run; a checkpoint is only resumed under an equal config."""
  method: str = "none"
  seed: int = 0
  steps: int = 10_000
  devices: int = 8
  batch_per_device: int = 1
  seq_len: int = 64
  d_model: int = 128
  n_layers: int = 5
  n_heads: int = 4
  d_ff: int = 512
  peak_lr: float = 1e-3
  warmup: int = 200
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.01
  eval_every: int = 250
  eval_batches: int = 8
  eval_batch: int = 64          # windows per held-out batch
  checkpoint_every: int = 500
  corpus_bytes: int = 64_000_000  # more than the stdlib's sources: all of them
  inner_steps: int = 32         # DiLoCo methods (the global params are evaluated)
  outer_lr: float = 0.7
  overlap: int = 2              # the -overlap DiLoCo methods: inner steps a sync runs beside

  @property
  def name(self) -> str:
    return f"{self.method}-s{self.seed}"

  @property
  def reset_interval(self) -> int | None:
    """LoCo's reset interval for this method (None: not a LoCo method)."""
    return parse_method(self.method)[1]


def parse_method(name: str) -> tuple[str, int | None]:
  """(the demo's method, LoCo's reset interval or None) of `loco4`, `loco4-r256`, `ef4`, ...

  Example:
    >>> parse_method("loco4-r256"), parse_method("loco2"), parse_method("ef4")
    (('loco4', 256), ('loco2', 1024), ('ef4', None))
  """
  from loco_jax.apps import demo
  m = re.fullmatch(r"(.+?)(?:-r(\d+))?", name)
  base, reset = m[1], m[2]
  if base not in BASE_METHODS:
    raise ValueError(f"unknown method {name!r}; accepted: {', '.join(BASE_METHODS)}, a LoCo "
                     f"one ({', '.join(demo.LOCO_METHODS)}) with -r<N> for a reset every N "
                     f"steps (-r0: never)")
  if reset is not None and base not in demo.LOCO_METHODS:
    raise ValueError(f"method {name!r}: -r<N> sets LoCo's reset interval; {base} has none")
  if base not in demo.LOCO_METHODS:
    return base, None
  return base, DEFAULT_RESET if reset is None else int(reset)


def check_config(config: LongRunConfig) -> None:
  """ValueError naming what is out of range or does not fit together."""
  parse_method(config.method)
  for field in dataclasses.fields(config):
    value, low = getattr(config, field.name), 0 if field.name in ("seed", "warmup") else 1
    if field.name != "method" and not (value >= low if field.type == "int" else value > 0):
      raise ValueError(f"--{field.name.replace('_', '-')} must be "
                       f"{'>= ' + str(low) if field.type == 'int' else '> 0'}, got {value}")
  if config.checkpoint_every % config.eval_every:
    raise ValueError(f"--checkpoint-every {config.checkpoint_every} must be a multiple of "
                     f"--eval-every {config.eval_every}: a run resumes at an evaluation")
  if config.eval_batch % config.devices:
    raise ValueError(f"--eval-batch {config.eval_batch} must be a multiple of the "
                     f"{config.devices} devices")
  if config.warmup >= config.steps:
    raise ValueError(f"--warmup {config.warmup} must be below --steps {config.steps}")


def demo_config(config: LongRunConfig):
  """The demo's config of this run's model and compressor."""
  from loco_jax.apps import demo
  return demo.DemoConfig(
      steps=config.steps, devices=config.devices, batch_per_device=config.batch_per_device,
      seq_len=config.seq_len, d_model=config.d_model, n_layers=config.n_layers,
      n_heads=config.n_heads, d_ff=config.d_ff, lr=config.peak_lr, seed=config.seed,
      reset_interval=config.reset_interval or 0, inner_steps=config.inner_steps,
      outer_lr=config.outer_lr, overlap=config.overlap)


# --- Data, schedule, evaluation -------------------------------------------------------------------

class Text:
  """The stdlib's sources: every 10th chunk of 64 KB held out (`demo.held_out_split`)."""

  def __init__(self, config: LongRunConfig):
    from loco_jax.apps import data, demo
    raw = data.stdlib_corpus(config.corpus_bytes)
    self.train, held_out = demo.held_out_split(raw, 0.1)
    self.eval_KxBxL = np.stack(list(data.batches(
        held_out, config.eval_batch, config.seq_len, seed=demo.EVAL_SEED,
        num_batches=config.eval_batches)))
    self.config = config

  def batch(self, step: int) -> np.ndarray:
    """Step `step`'s windows, int32 [global batch, seq_len + 1]: a function of (seed, step)."""
    from loco_jax.apps import data
    c = self.config
    return next(data.batches(self.train, c.devices * c.batch_per_device, c.seq_len,
                             seed=c.seed * 2**32 + step))

  def epochs(self, steps: int) -> float:
    """Train tokens of `steps` steps over the train text's length."""
    c = self.config
    return steps * c.devices * c.batch_per_device * c.seq_len / len(self.train)


def make_schedule(config: LongRunConfig) -> Callable[[int], Any]:
  """Linear warm-up from 0 to the peak, then cosine decay to `final_lr_fraction` of it."""
  import optax
  return optax.warmup_cosine_decay_schedule(
      0.0, config.peak_lr, config.warmup, config.steps,
      end_value=config.peak_lr * config.final_lr_fraction)


def make_eval(loss_fn: Callable, mesh, eval_KxBxL: np.ndarray) -> Callable[[Any], float]:
  """params -> mean loss over the held-out batches (compiled once, each batch over the mesh)."""
  import jax
  from jax.sharding import PartitionSpec as P

  def local(params, batch):
    return jax.lax.pmean(loss_fn(params, batch), AXIS)

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P()))

  def evaluate(params) -> float:
    # An overlapped DiLoCo run keeps its global params on the communication devices.
    params = jax.device_put(params, jax.NamedSharding(mesh, P()))
    return float(np.mean([float(fn(params, b)) for b in eval_KxBxL]))
  return evaluate


# --- What a record carries about the compressor ---------------------------------------------------

def error_stats(compressor_state: Any, devices: int) -> dict | None:
  """Norm of each device's dequantized error (mean and max over devices) and the error's block
  scales (LoCo: float32, one per block of int8; min, median, max over every device's nonzero
  ones), and the compressor's step count; None for a method without an error.

  LoCo's state holds per bucket int8 [rows * blocks * len] and scales [rows * blocks] per
  device (`LocoState`), stacked over the devices: e = q / s per block (0 where s = 0).
  """
  import jax
  from loco_jax import LocoState
  if type(compressor_state) is tuple and len(compressor_state) == 1:  # DiLoCo's one fragment
    compressor_state = compressor_state[0]
  groups = (list(compressor_state.groups.values()) if isinstance(compressor_state, LocoState)
            else None)
  error = ([g.error for g in groups] if groups is not None
           else getattr(compressor_state, "error", None))
  if error is None:
    return None
  rows = lambda x: np.asarray(jax.device_get(x)).reshape(devices, -1)
  errors = [rows(x) for x in jax.tree.leaves(error)]  # float32 (EF, CO3) or int8 codes (LoCo)
  stats: dict[str, Any] = {}
  if groups is not None:
    if any(g.error_scale is None for g in groups):
      raise ValueError("error_stats: a LoCo state with a fixed error_scale is not supported")
    scales = [rows(s) for s in jax.tree.leaves([g.error_scale for g in groups])]
    errors = [np.where(s[..., None] > 0, q.reshape(*s.shape, -1) / np.where(s > 0, s, 1.0)[
        ..., None], 0.0).reshape(devices, -1) for q, s in zip(errors, scales)]
    every = np.concatenate([s.reshape(-1) for s in scales])
    used = every[every > 0]
    stats.update(scale_min=float(used.min()) if used.size else 0.0,
                 scale_median=float(np.median(used)) if used.size else 0.0,
                 scale_max=float(used.max()) if used.size else 0.0,
                 zero_scale_fraction=float(np.mean(every == 0)))
  norms = np.sqrt(sum(np.sum(np.square(e.astype(np.float64)), axis=1) for e in errors))
  stats.update(norm_mean=float(norms.mean()), norm_max=float(norms.max()))
  # A field, not the `count` method every tuple has (EF's state is a NamedTuple without one).
  if "count" in getattr(compressor_state, "_fields", ()):
    stats["count"] = int(compressor_state.count)
  return stats


# --- Files ----------------------------------------------------------------------------------------

def write_records(path: Path, records: list[dict]) -> None:
  """The whole file at once (`files.write_atomic`): a kill leaves the old one or the new one."""
  from loco_jax.train import files
  files.write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


# What a run may continue with on another number of devices: the global batch (and so the data
# order) stays devices * batch_per_device.
MESH_KEYS = ("devices", "batch_per_device")


def check_same_config(path: Path, config: LongRunConfig) -> None:
  """Writes config.json for a new run; ValueError if an existing run's differs, but in
  --devices and --batch-per-device with the same global batch (devices * batch_per_device)."""
  from loco_jax.train import files
  want = dataclasses.asdict(config)
  if path.exists():
    # A field added since the run started has its default there.
    have = {**dataclasses.asdict(LongRunConfig()), **json.loads(path.read_text())}
    same_batch = (have["devices"] * have["batch_per_device"]
                  == config.devices * config.batch_per_device)
    diff = [f"{k}: run {have.get(k)!r}, now {want.get(k)!r}" for k in sorted(set(have) | set(want))
            if have.get(k) != want.get(k) and not (k in MESH_KEYS and same_batch)]
    if not same_batch:
      diff.append(f"global batch: run {have['devices']} x {have['batch_per_device']}, now "
                  f"{config.devices} x {config.batch_per_device} (another number of devices "
                  f"keeps devices * batch_per_device)")
    if diff:
      raise ValueError(f"{path} is another run's: {'; '.join(diff)}. Resume with its settings "
                       f"or use another --out")
  else:
    files.write_json_atomic(path, want)


class Busy(Exception):
  """Another process is running this run."""


@contextlib.contextmanager
def exclusive(folder: Path) -> Iterator[None]:
  """Holds folder/.lock (the kernel lets go of it when the process dies, however), so that two
  processes never run one run at once."""
  with open(folder / ".lock", "w") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise Busy(f"{folder} is being run by another process") from None
    yield


# --- A run ----------------------------------------------------------------------------------------

class Built(NamedTuple):
  """What a run trains with: a fresh state, its compiled step and the held-out evaluation."""
  state: Any                          # parallel.TrainState
  step: Callable                      # (state, batch) -> (state, mean train loss), compiled
  schedule: Callable[[int], Any]      # step count -> learning rate
  evaluate: Callable[[Any], float]    # params -> held-out loss
  compile_s: float


def build(config: LongRunConfig, text: Text) -> Built:
  """The demo's model and compressor (`demo.make_model`, `demo.make_compressor`) in the
  library's train step, with adamw on the warm-up and cosine schedule."""
  import jax.numpy as jnp
  import optax
  from loco_jax.apps import demo
  from loco_jax.train import parallel
  dc = demo_config(config)
  mesh = parallel.data_mesh(config.devices, AXIS)
  _, params, loss_fn = demo.make_model(dc)
  compressor = demo.make_compressor(parse_method(config.method)[0], dc, AXIS)
  schedule = make_schedule(config)
  optimizer = optax.adamw(schedule, weight_decay=config.weight_decay)
  options = demo.train_options(config.method, dc)   # init and step take the same options
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           **options)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params, compressor=compressor,
                                  **options)
  start = time.perf_counter()
  for lowered, _ in demo.lowered_programs(step, options.get("mode", "ddp"), state,
                                          jnp.asarray(text.batch(0))):
    compiled = lowered.compile()
  # DiLoCo's step picks its program each step (compiled again on first use).
  return Built(state, step if options else compiled, schedule,
               make_eval(loss_fn, mesh, text.eval_KxBxL), time.perf_counter() - start)


def param_norm(params: Any) -> float:
  import jax
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree.leaves(jax.device_get(params)))))


def measure(config: LongRunConfig, built: Built, state: Any, step: int, losses: list[float],
            times: list[float], wall_s: float, segment: int) -> dict:
  """The record of evaluation `step` (after `step` steps; `losses` and `times`: the steps since
  the previous evaluation)."""
  return {
      "run": config.name, "method": config.method, "seed": config.seed, "step": step,
      "eval_loss": common.finite_or_none(built.evaluate(state.params)),
      "train_loss": common.finite_or_none(float(np.mean(losses))) if losses else None,
      "train_losses": [common.finite_or_none(x) for x in losses],
      "lr": float(built.schedule(max(step - 1, 0))),  # the rate of the last step taken
      "param_norm": param_norm(state.params),
      "error": error_stats(state.compressor_state, config.devices),
      "step_time_s": float(np.median(times)) if times else None,
      "wall_s": wall_s, "segment": segment, "devices": config.devices}


def resume(config: LongRunConfig, folder: Path, built: Built,
           records: list[dict]) -> tuple[Any, int, list[dict], str | None]:
  """(state, step, records, how it was resharded) from the newest checkpoint, or the fresh
  state at step 0; the records after that step are dropped (they will be measured again). A
  checkpoint of another --devices is re-laid for this one (`checkpoint.restore(reshard=True)`:
  LoCo's errors averaged over the old devices)."""
  from loco_jax.train import checkpoint
  directory = folder / "checkpoints"
  if checkpoint.latest_step(directory) is None:
    return built.state, 0, [], None
  state, step, resharded = checkpoint.restore(directory, built.state, dataclasses.asdict(config),
                                              reshard=True, mesh_keys=MESH_KEYS)
  kept = [r for r in records if r["step"] <= step]
  if not kept or kept[-1]["step"] != step:
    raise ValueError(f"{folder}: checkpoint {step} has no record of its evaluation in "
                     f"records.jsonl; the run's files do not belong together")
  return state, step, kept, None if resharded is None else str(resharded)


def run(config: LongRunConfig, out: Path, kill_after: int | None = None) -> list[dict]:
  """Trains (or continues) one run to `config.steps`; returns its records.

  `kill_after`: the process sends itself SIGKILL right after step `kill_after` (after that
  step's record, before its checkpoint): what the resume test does to it.
  """
  from loco_jax.train import checkpoint
  check_config(config)
  start_time = time.perf_counter()
  folder = out / config.name
  folder.mkdir(parents=True, exist_ok=True)
  with exclusive(folder):
    check_same_config(folder / "config.json", config)
    path = folder / "records.jsonl"
    records = common.read_jsonl(path)
    if records and records[-1]["step"] == config.steps:
      print(f"{config.name}: complete ({config.steps} steps)", file=sys.stderr)
      return records
    text = Text(config)
    built = build(config, text)
    state, done, records, resharded = resume(config, folder, built, records)
    wall, segment = (records[-1]["wall_s"], records[-1]["segment"] + 1) if records else (0.0, 0)
    elapsed = lambda: wall + time.perf_counter() - start_time
    print(f"{config.name}: {'from step ' + str(done) if done else 'new'} on {config.devices} "
          f"devices, {text.epochs(config.steps):.2f} epochs of {len(text.train):,} train bytes in "
          f"{config.steps} steps, compiled in {built.compile_s:.0f} s", file=sys.stderr, flush=True)
    if resharded:
      print(f"{config.name}: {resharded}", file=sys.stderr, flush=True)
    if not records:
      records = [measure(config, built, state, 0, [], [], elapsed(), segment)]
      write_records(path, records)
    losses, times = [], []
    for i in range(done, config.steps):
      tick = time.perf_counter()
      state, loss = built.step(state, text.batch(i))
      losses.append(float(loss))
      times.append(time.perf_counter() - tick)
      done = i + 1
      if done % config.eval_every == 0 or done == config.steps:
        records.append(measure(config, built, state, done, losses, times, elapsed(), segment))
        if resharded:  # the first record of a segment resumed on another mesh says how
          records[-1]["resharded"], resharded = resharded, None
        write_records(path, records)
        r = records[-1]
        print(f"{config.name} {done:>6}: train {r['train_loss']:.4f} eval {r['eval_loss']:.4f} "
              f"lr {r['lr']:.2e} {r['step_time_s'] * 1e3:.0f} ms/step", file=sys.stderr, flush=True)
        losses, times = [], []
      if done == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
      if done % config.checkpoint_every == 0 and done < config.steps:
        checkpoint.save(folder / "checkpoints", done, state, dataclasses.asdict(config), keep=2)
    return records


# --- Timing ---------------------------------------------------------------------------------------

class Timing(NamedTuple):
  """One method's costs: medians over the timed steps (CPU: this process, all its threads)."""
  method: str
  compile_s: float
  step_s: float
  step_cpu_s: float
  eval_s: float
  eval_cpu_s: float


def time_methods(config: LongRunConfig, methods: list[str], steps: int) -> list[Timing]:
  """Each method's compile time and its step's and evaluation's wall and CPU time."""
  text, rows = Text(config), []
  for method in methods:
    built = build(dataclasses.replace(config, method=method), text)
    state, walls, cpus = built.state, [], []
    for i in range(steps + 1):  # the first step is not timed
      wall, cpu = time.perf_counter(), time.process_time()
      state, loss = built.step(state, text.batch(i))
      float(loss)
      walls.append(time.perf_counter() - wall)
      cpus.append(time.process_time() - cpu)
    built.evaluate(state.params)  # compiles
    wall, cpu = time.perf_counter(), time.process_time()
    built.evaluate(state.params)
    rows.append(Timing(method, built.compile_s, float(np.median(walls[1:])),
                       float(np.median(cpus[1:])), time.perf_counter() - wall,
                       time.process_time() - cpu))
    print(f"{method}: {rows[-1].step_s * 1e3:.0f} ms/step, {rows[-1].step_cpu_s * 1e3:.0f} ms "
          f"CPU", file=sys.stderr, flush=True)
  return rows


def timing_table(config: LongRunConfig, rows: list[Timing]) -> str:
  """Markdown: each method's step time and what a run of `config.steps` steps would take."""
  evals = config.steps // config.eval_every + 1
  lines = [f"| method | compile s | step ms | step CPU ms | eval s | run of {config.steps} steps: "
           f"wall h | CPU h |", "|---|---|---|---|---|---|---|"]
  for t in rows:
    wall = (t.compile_s + config.steps * t.step_s + evals * t.eval_s) / 3600
    cpu = (config.steps * t.step_cpu_s + evals * t.eval_cpu_s) / 3600
    lines.append(f"| {t.method} | {t.compile_s:.1f} | {t.step_s * 1e3:.0f} | "
                 f"{t.step_cpu_s * 1e3:.0f} | {t.eval_s:.2f} | {wall:.2f} | {cpu:.2f} |")
  return "\n".join(lines)


# --- Command line ---------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
  d = LongRunConfig()
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("mode", choices=["run", "campaign", "time"])
  ap.add_argument("--method", default=d.method, help="run: the method")
  ap.add_argument("--methods", default="none,bf16,loco4,ef4,loco3,loco2,co3-fp4",
                  help="time: the methods, comma-separated")
  ap.add_argument("--runs", default=None,
                  help="campaign: method:seed,... in order (default: " +
                       ",".join(f"{m}:{s}" for m, s in CAMPAIGN) + "); each worker takes "
                       "the next one that is neither complete nor run by another")
  ap.add_argument("--out", default="runs/long")
  ap.add_argument("--kill-after-step", type=int, default=None,
                  help="run: SIGKILL this process after that step's record (the resume test)")
  ap.add_argument("--timing-steps", type=int, default=30, help="time: steps timed per method")
  ap.add_argument("--cache-dir", default=None,
                  help="a persistent XLA compilation cache (a restarted run, or another seed of "
                       "a method, then skips compiling), e.g. runs/long/xla-cache")
  for field in dataclasses.fields(LongRunConfig):
    if field.name != "method":
      ap.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                      default=field.default, help=f"default {field.default}")
  return ap


def _runs(text: str | None) -> list[tuple[str, int]]:
  if text is None:
    return list(CAMPAIGN)
  runs = [r.split(":") for r in text.split(",")]
  if not all(len(r) == 2 and r[1].isdigit() for r in runs):
    raise ValueError(f"--runs {text!r}: expected method:seed,... e.g. none:0,loco4:1")
  return [(m, int(seed)) for m, seed in runs]


def campaign(configs: list[LongRunConfig], out: Path) -> None:
  """Runs each config in turn, skipping those another worker holds: started N times, N workers
  share the list; started again after a kill, each continues where the runs stopped."""
  for config in configs:
    try:
      run(config, out)
    except Busy as e:
      print(f"{config.name}: skipped, {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(LongRunConfig)
            if f.name != "method"}
  config = LongRunConfig(method=args.method, **fields)
  out = Path(args.out)
  try:
    configs = [config]
    if args.mode == "campaign":
      configs = [dataclasses.replace(config, method=m, seed=s) for m, s in _runs(args.runs)]
    for c in configs:
      check_config(c)
  except ValueError as e:
    print(f"long_run: error: {e}", file=sys.stderr)
    return 2
  # The -overlap methods run each sync on a second device a worker.
  overlapped = any(c.method.endswith("-overlap") for c in configs)
  common.setup(config.devices * (2 if overlapped else 1), "cpu", cache_dir=args.cache_dir)
  try:
    if args.mode == "time":
      print(timing_table(config, time_methods(config, args.methods.split(","),
                                              args.timing_steps)))
    elif args.mode == "campaign":
      campaign(configs, out)
    else:
      run(config, out, args.kill_after_step)
  except (ValueError, Busy) as e:
    print(f"long_run: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
