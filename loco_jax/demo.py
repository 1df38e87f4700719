"""`loco-jax demo`: a small byte-level GPT trained on simulated CPU devices, once per method."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from loco_jax import files

METHODS = ("none", "bf16", "int4-noef", "ef4", "loco4", "loco4-fixed", "co3-fp4")
DESCRIPTIONS = {
    "none": "float32 all-reduce (uncompressed)",
    "bf16": "bfloat16 all-reduce",
    "int4-noef": "4-bit absmax blocks, no error feedback (like ZeRO++ qgZ)",
    "ef4": "4-bit absmax blocks, classic error feedback (beta=0, float32 error)",
    "loco4": "LoCo: 4-bit blocks, 8-bit error averaged with beta=0.8, reset every 1024",
    "loco4-fixed": "LoCo with the paper's one fixed scale s (default 2**17) and s_e = 4s",
    "co3-fp4": "CO3: fp4 with a GenNorm-fitted scale, Huffman, error decay gamma=0.7",
}
RESULT_KEYS = ("method", "final_loss", "eval_loss", "gradient_bits_per_param",
               "wire_bits_per_param", "step_time_s")
AXIS = "data"
EVAL_SEED = 2024  # the held-out windows do not change with --seed
_SCALAR_BYTES = 64  # collectives this small carry a loss or a finiteness flag, not the gradient


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """Everything that fixes a demo run; the defaults are the zero-configuration demo."""
  steps: int = 300
  devices: int = 8
  batch_per_device: int = 8
  seq_len: int = 64
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  d_ff: int = 256
  lr: float = 2e-3
  warmup: int = 20
  seed: int = 0
  block_size: int = 2048
  fixed_scale: float = 2.0 ** 17
  eval_batches: int = 16
  corpus_bytes: int = 4_000_000

  @property
  def global_batch(self) -> int:
    return self.devices * self.batch_per_device


class Corpus(NamedTuple):
  """The batches every method sees, in the same order: int32 [steps, B, L + 1] and [K, B, L + 1]."""
  train_SxBxL: np.ndarray
  eval_KxBxL: np.ndarray
  source: str


class MethodResult(NamedTuple):
  """One method's run. `as_json` gives the results.json record."""
  method: str
  final_loss: float              # mean train loss over the last 10% of steps
  eval_loss: float               # mean loss on the held-out batches after the last step
  gradient_bits_per_param: float  # the gradient collective's buffer (payload + scales), from HLO
  wire_bits_per_param: float      # sent per device per step, every collective, from HLO
  step_time_s: float             # median wall time of a step (after compilation)
  losses: list[float]            # train loss of every step
  compile_s: float
  state_bytes_per_device: int    # the compressor's state on one device
  collectives: list[Any]         # comm.Collective of the lowered step

  def as_json(self) -> dict[str, Any]:
    """The results.json record; a diverged (non-finite) loss is null."""
    finite = lambda v: v if not isinstance(v, float) or math.isfinite(v) else None
    return {k: finite(getattr(self, k)) for k in RESULT_KEYS}


class DemoError(ValueError):
  """Bad input: printed on stderr, exit status 2."""


# --- Methods --------------------------------------------------------------------------------------

def co3_status() -> str | None:
  """None if loco_jax.co3 imports, else why it does not."""
  try:
    module = importlib.import_module("loco_jax.co3")
  except ImportError as e:
    return f"loco_jax.co3 is not importable ({e})"
  if not hasattr(module, "co3"):
    return "loco_jax.co3 has no co3()"
  return None


def available_methods() -> tuple[str, ...]:
  """METHODS, less co3-fp4 while loco_jax.co3 is missing."""
  return tuple(m for m in METHODS if m != "co3-fp4" or co3_status() is None)


def make_compressor(method: str, config: DemoConfig = DemoConfig(),
                    axis_name: str | None = AXIS):
  """The optax transformation that averages gradients over `axis_name` for a demo method.

  Example:
    >>> compressor = make_compressor("loco4")   # loco_jax.loco(bits=4, axis_name="data")
  """
  from loco_jax import baselines, loco
  b = config.block_size
  if method == "none":
    return baselines.uncompressed(axis_name)
  if method == "bf16":
    return baselines.bf16(axis_name)
  if method == "int4-noef":
    return baselines.int_quantized(4, b, axis_name)
  if method == "ef4":
    return baselines.error_feedback(4, b, axis_name)
  if method == "loco4":
    return loco(bits=4, block_size=b, axis_name=axis_name)
  if method == "loco4-fixed":
    s = config.fixed_scale
    return loco(bits=4, scale=s, error_scale=4 * s, block_size=b, axis_name=axis_name)
  if method == "co3-fp4":
    why = co3_status()
    if why:
      raise DemoError(f"method co3-fp4 is unavailable: {why}")
    return importlib.import_module("loco_jax.co3").co3(fmt="fp4", gamma=0.7, axis_name=axis_name)
  raise DemoError(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")


# --- Devices, data, model -------------------------------------------------------------------------

def setup_devices(n: int, platform: str | None = "cpu") -> None:
  """Asks jax for `n` CPU devices (and the CPU platform) before its backend starts.

  If the backend already runs (a test, a notebook), checks that it has at least `n` devices.
  """
  import jax
  try:
    if platform and not os.environ.get("JAX_PLATFORMS"):
      jax.config.update("jax_platforms", platform)
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    pass  # backend already initialized: use what it has
  if jax.device_count() < n:
    raise DemoError(f"--devices {n} asks for more devices than jax has ({jax.device_count()}); "
                    f"jax was started before the demo could set the CPU device count")


def held_out_split(raw: bytes, fraction: float = 0.1,
                   chunk: int = 65_536) -> tuple[bytes, bytes]:
  """(train, eval): every 1/fraction-th chunk of `chunk` bytes is held out, so that the eval
  text is drawn from the whole corpus (the stdlib's last files are codec tables); corpora of
  fewer than 2/fraction chunks are split by `data.split` (the last fraction)."""
  from loco_jax import data
  every = round(1 / fraction)
  chunks = [raw[i:i + chunk] for i in range(0, len(raw), chunk)]
  if len(chunks) < 2 * every:
    return data.split(raw, fraction)
  held = set(range(every // 2, len(chunks), every))
  return (b"".join(c for i, c in enumerate(chunks) if i not in held),
          b"".join(c for i, c in enumerate(chunks) if i in held))


def load_corpus(config: DemoConfig, data_path: str | os.PathLike | None = None) -> Corpus:
  """Train and eval batches of the stdlib sources (or of the text at `data_path`)."""
  from loco_jax import data
  if data_path is None:
    raw, source = data.stdlib_corpus(config.corpus_bytes), "the Python standard library sources"
  else:
    raw, source = data.text_corpus(data_path, config.corpus_bytes), str(data_path)
  b, l = config.global_batch, config.seq_len
  need = 2 * (l + 1) + b
  if len(raw) < need:
    raise DemoError(f"text at {source} has {len(raw)} bytes; the demo needs at least {need} "
                    f"(two windows of seq_len + 1 and some to split off for evaluation)")
  train, held_out = held_out_split(raw, 0.1)
  train_SxBxL = np.stack(list(data.batches(train, b, l, seed=config.seed,
                                           num_batches=config.steps)))
  if len(held_out) < l + 1:
    held_out = train  # too short to hold any out: evaluate on train windows
  # Random windows over all of the held-out text, the same for every seed and method.
  eval_b = min(b, max((len(held_out) - 1) // l, 1))
  eval_list = list(data.batches(held_out, eval_b, l, seed=EVAL_SEED,
                                num_batches=config.eval_batches))
  return Corpus(train_SxBxL, np.stack(eval_list), source)


def make_model(config: DemoConfig):
  """(graphdef, params, loss_fn) of the demo's GPT."""
  from loco_jax.models import GPT, GPTConfig, gpt
  from flax import nnx
  gpt_config = GPTConfig(seq_len=config.seq_len, d_model=config.d_model,
                         n_layers=config.n_layers, n_heads=config.n_heads, d_ff=config.d_ff)
  graphdef, params = gpt.split_model(GPT(gpt_config, rngs=nnx.Rngs(config.seed)))
  return graphdef, params, lambda p, batch: gpt.apply_loss(graphdef, p, batch)


def make_optimizer(config: DemoConfig):
  """adamw with a linear warm-up to a constant `lr`."""
  import optax
  warmup = min(config.warmup, max(config.steps - 1, 0))
  schedule = optax.join_schedules(
      [optax.linear_schedule(config.lr / max(warmup, 1), config.lr, max(warmup, 1)),
       optax.constant_schedule(config.lr)], [max(warmup, 1)]) if warmup else config.lr
  return optax.adamw(schedule, weight_decay=0.01)


# --- Measuring ------------------------------------------------------------------------------------

def gradient_collectives(found: Sequence[Any]) -> list[Any]:
  """The collectives that carry the gradient payload (codes plus scales), in HLO order.

  The first non-scalar all-to-all, all-reduce or reduce-scatter of the step (scalars carry a
  loss or a flag), with the others of its kind when the gradient goes leaf by leaf (pmean of a
  pytree is one all-reduce a leaf); for a method that only gathers (top-k, CO3's server
  average), its all-gathers.
  """
  big = [c for c in found if c.nbytes > _SCALAR_BYTES and not c.conditional]
  for ops in (("all-to-all", "all-reduce", "reduce-scatter"), ("all-gather",)):
    chosen = [c for c in big if c.op in ops]
    if chosen:
      return [c for c in chosen if c.op == chosen[0].op]
  return []


def gradient_bits(found: Sequence[Any], n_params: int) -> float:
  """Bits per parameter of one device's gradient payload: the buffer of `gradient_collectives`
  (for an all-gather, one device's share: its result / group size)."""
  nbytes = sum(c.nbytes / (c.group_size if c.op == "all-gather" else 1)
               for c in gradient_collectives(found))
  return 8.0 * nbytes / n_params


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a pytree of (possibly sharded) jax arrays."""
  import jax
  return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)))


def _make_eval(loss_fn: Callable, mesh) -> Callable:
  import jax
  from jax.sharding import PartitionSpec as P

  def local(params, batch):
    return jax.lax.pmean(loss_fn(params, batch), AXIS)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P()))


def evaluate(loss_fn: Callable, params: Any, eval_KxBxL: np.ndarray, mesh) -> float:
  """Mean loss over the held-out batches; each batch split over the mesh when it divides."""
  import jax
  n = mesh.shape[AXIS]
  if eval_KxBxL.shape[1] % n == 0:
    fn = _make_eval(loss_fn, mesh)
  else:
    fn = jax.jit(loss_fn)
    params = jax.device_get(params)
  return float(np.mean([float(fn(params, batch)) for batch in eval_KxBxL]))


def run_method(name: str, compressor, config: DemoConfig, corpus: Corpus,
               progress: Progress | None = None, optimizer=None, mode: str = "ddp",
               observe: Callable[[Any, int], None] | None = None,
               **step_kwargs: Any) -> MethodResult:
  """Trains the demo model with `compressor` averaging the gradients over the devices.

  `mode` and `step_kwargs` go to `parallel.make_train_step` ("zero2" needs a compressor with
  reduce-scatter semantics); `observe(state, step)` is called after every step.

  Example:
    >>> config = DemoConfig(steps=20)
    >>> result = run_method("loco4", make_compressor("loco4"), config, load_corpus(config))
  """
  import jax.numpy as jnp
  from loco_jax import comm, parallel
  from loco_jax.models import num_params

  mesh = parallel.data_mesh(config.devices, AXIS)
  _, params, loss_fn = make_model(config)
  n_params = num_params(params)
  optimizer = optimizer or make_optimizer(config)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, specs, params,
                                  compressor=compressor, mode=mode, **step_kwargs)
  batches = corpus.train_SxBxL
  start = time.perf_counter()
  lowered = step.jitted.lower(state, jnp.asarray(batches[0]))
  found = comm.collectives(lowered.as_text(dialect="hlo"), config.devices)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  losses, times = [], []
  for i, batch in enumerate(batches):
    t0 = time.perf_counter()
    state, loss = compiled(state, jnp.asarray(batch))
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    if observe:
      observe(state, i + 1)
    if progress:
      progress.update(name, i + 1, losses[-1], times[-1])
  final = state.params if mode == "ddp" else parallel.unshard_params(state.params, params)
  tail = losses[-max(len(losses) // 10, 1):]
  return MethodResult(
      method=name, final_loss=float(np.mean(tail)),
      eval_loss=evaluate(loss_fn, final, corpus.eval_KxBxL, mesh),
      gradient_bits_per_param=round(gradient_bits(found, n_params), 4),
      wire_bits_per_param=round(comm.wire_bits_per_param(found, n_params), 4),
      step_time_s=float(np.median(times[1:] if len(times) > 1 else times)),
      losses=losses, compile_s=compile_s,
      state_bytes_per_device=per_device_bytes(state.compressor_state),
      collectives=list(found))


# --- Output ---------------------------------------------------------------------------------------

class Progress:
  """A one-line progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""

  def __init__(self, methods: Sequence[str], steps: int, stream=None, width: int = 24):
    self.methods, self.steps, self.width = list(methods), steps, width
    self.stream = stream or sys.stderr
    self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.start = time.perf_counter()
    self.done_steps = 0
    self._last_decile = -1

  def update(self, method: str, step: int, loss: float, step_s: float) -> None:
    index = self.methods.index(method)
    self.done_steps = index * self.steps + step
    total = len(self.methods) * self.steps
    elapsed = time.perf_counter() - self.start
    eta = elapsed / self.done_steps * (total - self.done_steps)
    filled = round(self.width * step / self.steps)
    bar = "#" * filled + "-" * (self.width - filled)
    line = (f"[{index + 1}/{len(self.methods)}] {method:<11} [{bar}] {step:>5}/{self.steps} "
            f"loss {loss:6.3f}  {step_s * 1e3:5.0f} ms/step  elapsed {_clock(elapsed)} "
            f"eta {_clock(eta)}")
    if self.tty:
      self.stream.write("\r" + line + ("\n" if step == self.steps else ""))
      self.stream.flush()
    else:
      decile = 10 * step // self.steps
      if decile != self._last_decile or step == self.steps:
        self._last_decile = 0 if step == self.steps else decile
        print(line, file=self.stream, flush=True)

  def note(self, text: str) -> None:
    print(text, file=self.stream, flush=True)


def _clock(seconds: float) -> str:
  seconds = int(seconds) if math.isfinite(seconds) else 0
  return f"{seconds // 60}:{seconds % 60:02d}"


def format_table(results: Sequence[MethodResult], unavailable: dict[str, str] | None = None) -> str:
  """The demo's table: losses (and their change against `none`), bits, step time."""
  base = next((r for r in results if r.method == "none"), None)
  rel = lambda v, b: "" if base is None or not math.isfinite(v) else f"{100 * (v / b - 1):+.1f}%"
  header = (f"{'method':<12} {'train loss':>10} {'vs none':>8} {'eval loss':>10} {'vs none':>8} "
            f"{'grad bits':>9} {'wire bits':>9} {'step s':>7}")
  lines = [header, "-" * len(header)]
  for r in results:
    lines.append(
        f"{r.method:<12} {r.final_loss:>10.4f} "
        f"{rel(r.final_loss, base.final_loss if base else 1):>8} {r.eval_loss:>10.4f} "
        f"{rel(r.eval_loss, base.eval_loss if base else 1):>8} "
        f"{r.gradient_bits_per_param:>9.2f} {r.wire_bits_per_param:>9.2f} {r.step_time_s:>7.3f}")
  for method, why in (unavailable or {}).items():
    lines.append(f"{method:<12} unavailable: {why}")
  lines.append("grad bits: the gradient collective's buffer (codes + scales) * 8 / params; wire "
               "bits: what each device sends per parameter and step, over every collective "
               "(ring all-reduce 2(n-1)/n); both read from the step's lowered HLO.")
  return "\n".join(lines)


def write_curves(path: Path, results: Sequence[MethodResult]) -> None:
  """loss_curves.csv: step, then one train-loss column per method (written atomically)."""
  rows = ["step," + ",".join(r.method for r in results)]
  for i in range(max((len(r.losses) for r in results), default=0)):
    rows.append(f"{i + 1}," + ",".join(f"{r.losses[i]:.5f}" if i < len(r.losses) else ""
                                       for r in results))
  files.write_atomic(path, "\n".join(rows) + "\n")


def plot_curves(path: Path, results: Sequence[MethodResult], title: str = "") -> bool:
  """loss_curves.png with matplotlib (False, and nothing written, if it is not installed)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  base = next((np.asarray(r.losses) for r in results if r.method == "none"), None)
  fig, axes = plt.subplots(1, 2 if base is not None else 1, figsize=(12, 4.8), dpi=100,
                           squeeze=False)
  ax, diff = axes[0][0], (axes[0][1] if base is not None else None)
  for r in results:
    y = np.asarray(r.losses)
    k = max(len(y) // 25, 1)  # moving average over ~4% of the run
    smooth = lambda v: np.convolve(v, np.ones(k) / k, mode="valid")
    line, = ax.plot(np.arange(k, len(y) + 1), smooth(y), lw=1.6,
                    label=f"{r.method} (eval {r.eval_loss:.3f}, {r.wire_bits_per_param:.0f} b/p)")
    ax.plot(np.arange(1, len(y) + 1), y, lw=0.5, alpha=0.25, color=line.get_color())
    if diff is not None and len(y) == len(base):
      diff.plot(np.arange(k, len(y) + 1), smooth(y - base), lw=1.4, color=line.get_color(),
                label=r.method)
  finite = [v for r in results for v in r.losses[len(r.losses) // 5:] if math.isfinite(v)]
  if finite:
    lo, hi = min(finite), max(finite)
    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.3 * (hi - lo))
  ax.set_xlabel("step")
  ax.set_ylabel("train loss (nats / byte)")
  ax.set_title(title or "loco-jax demo: train loss per method", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  if diff is not None:
    gaps = [v for r in results if len(r.losses) == len(base)
            for v in (np.asarray(r.losses) - base)[len(base) // 5:] if math.isfinite(v)]
    if gaps:
      spread = max(np.percentile(np.abs(gaps), 98), 1e-3)
      diff.set_ylim(-spread, spread)
    diff.axhline(0, color="k", lw=0.6)
    diff.set_xlabel("step")
    diff.set_ylabel("train loss minus none's (same batches)")
    diff.set_title("the cost of compression (below 0: better than fp32)", fontsize=10)
    diff.grid(alpha=0.3)
  fig.tight_layout()
  files.save_figure_atomic(fig, path)
  plt.close(fig)
  return True


def summary(results: Sequence[MethodResult]) -> str:
  """Two sentences that read the table for a newcomer."""
  by = {r.method: r for r in results}
  if "none" not in by:
    return ""
  base = by["none"].eval_loss
  pct = lambda m: 100 * (by[m].eval_loss / base - 1)
  parts = []
  if "loco4" in by:
    parts.append(f"LoCo-4 sends {by['loco4'].gradient_bits_per_param:.2f} gradient bits a "
                 f"parameter instead of {by['none'].gradient_bits_per_param:.0f} and ends "
                 f"{pct('loco4'):+.1f}% from uncompressed on held-out text")
  if "int4-noef" in by:
    parts.append(f"the same 4 bits without error feedback end {pct('int4-noef'):+.1f}%")
  if "ef4" in by:
    parts.append(f"classic error feedback {pct('ef4'):+.1f}%")
  return ("; ".join(parts) + ". One seed: differences under ~1% are within seed noise "
          "(docs/EXPERIMENTS.md has the sweep).") if parts else ""


# --- Command line ---------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
  return value


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
  return value


def parser() -> argparse.ArgumentParser:
  d = DemoConfig()
  p = argparse.ArgumentParser(
      prog="loco-jax demo",
      description="Trains a small byte-level GPT data-parallel over simulated CPU devices once "
                  "per gradient-communication method (same seed and data order) and compares "
                  "loss and bits on the wire. Methods: " +
                  "; ".join(f"{m}: {DESCRIPTIONS[m]}" for m in METHODS) + ".")
  p.add_argument("--methods", default=None,
                 help=f"comma-separated subset of {','.join(METHODS)} (default: all available)")
  p.add_argument("--steps", type=_positive_int, default=d.steps, help="train steps per method")
  p.add_argument("--devices", type=_positive_int, default=d.devices,
                 help="simulated CPU devices (data-parallel workers)")
  p.add_argument("--batch", type=_positive_int, default=d.batch_per_device,
                 help="sequences per device per step")
  p.add_argument("--seq-len", type=_positive_int, default=d.seq_len, help="tokens per sequence")
  p.add_argument("--d-model", type=_positive_int, default=d.d_model, help="model width")
  p.add_argument("--layers", type=_positive_int, default=d.n_layers, help="transformer blocks")
  p.add_argument("--heads", type=_positive_int, default=d.n_heads, help="attention heads")
  p.add_argument("--d-ff", type=_positive_int, default=None, help="MLP width (default 4 x d-model)")
  p.add_argument("--lr", type=_positive_float, default=d.lr, help="adamw learning rate")
  p.add_argument("--seed", type=int, default=d.seed, help="model init and data order")
  p.add_argument("--fixed-scale", type=_positive_float, default=d.fixed_scale,
                 help="loco4-fixed's global scale s (the paper: 2**17 pre-training)")
  p.add_argument("--eval-batches", type=_positive_int, default=d.eval_batches,
                 help="held-out batches for the eval loss")
  p.add_argument("--data", default=None,
                 help="a text file or folder to train on (default: the stdlib's own sources)")
  p.add_argument("--out", default=None, help="output folder (default runs/demo-<timestamp>)")
  return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
  return DemoConfig(steps=args.steps, devices=args.devices, batch_per_device=args.batch,
                    seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads, d_ff=args.d_ff or 4 * args.d_model, lr=args.lr,
                    seed=args.seed, fixed_scale=args.fixed_scale, eval_batches=args.eval_batches)


def _choose_methods(text: str | None) -> tuple[list[str], dict[str, str]]:
  """(methods to run, {method: why unavailable}); DemoError on unknown names."""
  why = co3_status()
  unavailable = {"co3-fp4": why} if why else {}
  if text is None:
    return [m for m in METHODS if m not in unavailable], unavailable
  chosen = [m.strip() for m in text.split(",") if m.strip()]
  unknown = [m for m in chosen if m not in METHODS]
  if unknown or not chosen:
    raise DemoError(f"unknown method {', '.join(map(repr, unknown)) or '(none given)'}; "
                    f"accepted: {', '.join(METHODS)}")
  for m in chosen:
    if m in unavailable:
      raise DemoError(f"method {m} is unavailable: {unavailable[m]}")
  return list(dict.fromkeys(chosen)), {}


def _check_config(config: DemoConfig) -> None:
  if config.d_model % config.n_heads:
    raise DemoError(f"--d-model {config.d_model} must be divisible by --heads {config.n_heads}")


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the demo; returns the exit status (2 on bad input, 130 when interrupted)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args = parser().parse_args(argv)
  except SystemExit as e:  # argparse: --help (0) or a usage error (2, message already printed)
    return int(e.code or 0)
  try:
    config = config_from_args(args)
    _check_config(config)
    methods, unavailable = _choose_methods(args.methods)
    if args.data is not None and not Path(args.data).exists():
      raise DemoError(f"--data {args.data}: no such file or folder; expected a text file or a "
                      f"folder of .txt/.md/.py/.rst files")
    setup_devices(config.devices)
    corpus = load_corpus(config, args.data)
  except (DemoError, ValueError) as e:
    print(f"loco-jax demo: error: {e}", file=sys.stderr)
    return 2

  out = Path(args.out or Path("runs") / f"demo-{datetime.datetime.now():%Y%m%d-%H%M%S}")
  out.mkdir(parents=True, exist_ok=True)
  _, params, _ = make_model(config)
  from loco_jax.models import num_params
  progress = Progress(methods, config.steps)
  progress.note(
      f"loco-jax demo: {num_params(params):,}-parameter byte-level GPT on {corpus.source}, "
      f"{config.devices} devices x {config.batch_per_device} sequences x {config.seq_len} "
      f"tokens, {config.steps} steps per method, adamw lr {config.lr:g}, seed {config.seed}; "
      f"methods: {', '.join(methods)}" +
      "".join(f"\n  {m} unavailable: {why}" for m, why in unavailable.items()))
  results = []
  start = time.perf_counter()
  try:
    for method in methods:
      results.append(run_method(method, make_compressor(method, config), config, corpus,
                                progress))
  except KeyboardInterrupt:
    print("\nloco-jax demo: interrupted; nothing written", file=sys.stderr)
    return 130
  total_s = time.perf_counter() - start

  files.write_json_atomic(out / "results.json", [r.as_json() for r in results])
  write_curves(out / "loss_curves.csv", results)
  plotted = plot_curves(out / "loss_curves.png", results,
                        f"loco-jax demo: {num_params(params):,} params, {config.devices} devices")
  print(format_table(results, unavailable))
  text = summary(results)
  if text:
    print(text)
  print(f"total {_clock(total_s)} (compile {sum(r.compile_s for r in results):.0f} s); wrote "
        f"{out / 'results.json'}, loss_curves.csv" +
        (", loss_curves.png" if plotted else " (no PNG: matplotlib is not installed)"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
