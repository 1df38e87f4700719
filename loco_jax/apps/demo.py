"""`loco-jax demo`: a small byte-level GPT trained on simulated CPU devices, once per method."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
from tqdm import tqdm

from loco_jax.apps import demo_output
from loco_jax.apps.demo_output import MethodResult
from loco_jax.train import files

METHODS = ("none", "bf16", "int4-noef", "ef4", "loco4", "loco4-fixed", "co3-fp4", "ef2", "ef3",
           "loco2", "loco3", "co3-fp8", "co3-fp4-coded", "loco4-entropy", "diloco",
           "diloco-loco4", "diloco-loco4-quantized", "diloco-overlap", "diloco-loco4-overlap",
           "diloco-loco4-quantized-overlap")
CO3_METHODS = {"co3-fp4": ("fp4", "bf16"), "co3-fp8": ("fp8", "bf16"),
               "co3-fp4-coded": ("fp4", "coded")}  # method -> (fmt, gather)
# Without --methods the demo runs these (the 2- and 3-bit methods are asked for by name).
DEFAULT_METHODS = METHODS[:7]
# The ones --reset-interval applies to.
LOCO_METHODS = ("loco4", "loco4-fixed", "loco2", "loco3", "loco4-entropy")
# DiLoCo (parallel.make_train_step(mode="diloco")): method -> the outer average's method.
DILOCO_METHODS = {"diloco": "none", "diloco-loco4": "loco4",
                  "diloco-loco4-quantized": "loco4-quantized"}
DILOCO_METHODS.update({f"{m}-overlap": average for m, average in DILOCO_METHODS.items()})
# loco4-entropy's slots: the demo's 4-bit codes carry 1.7-1.9 bits of entropy
# (docs/results/co3.md); a slot that does not fit sends the step raw.
ENTROPY_CAPACITY_BITS = 2.5
DESCRIPTIONS = {
    "none": "float32 all-reduce (uncompressed)",
    "bf16": "bfloat16 all-reduce",
    "int4-noef": "4-bit absmax blocks, no error feedback (like ZeRO++ qgZ)",
    "ef4": "4-bit absmax blocks, classic error feedback (beta=0, float32 error)",
    "loco4": "LoCo: 4-bit blocks, 8-bit error averaged with beta=0.8, reset every 1024",
    "loco4-fixed": "LoCo with the paper's one fixed scale s (default 2**17) and s_e = 4s",
    "loco4-entropy": f"loco4 with the all-to-all's codes Huffman-coded on the host in slots of "
                     f"{ENTROPY_CAPACITY_BITS} bits a code",
    "co3-fp4": "CO3: fp4 with a GenNorm-fitted scale, Huffman, error decay gamma=0.7; each "
               "device's shard Huffman-coded through one all-to-all, bf16 all-gather",
    "co3-fp8": "CO3 as co3-fp4, in fp8 [1,5,2]",
    "co3-fp4-coded": "CO3 as co3-fp4, every device at the finest of the devices' scales; the "
                     "exact sums of the fp4 levels Huffman-coded in the all-gather",
    "ef2": "2-bit absmax blocks, classic error feedback (beta=0, float32 error)",
    "ef3": "3-bit absmax blocks, classic error feedback (beta=0, float32 error)",
    "loco2": "LoCo at 2 bits with loco(bits=2)'s defaults: blocks of 128 scaled to 1.5 x rms "
             "(clipped), 8-bit error, beta=0.8",
    "loco3": "LoCo at 3 bits with loco(bits=3)'s defaults: blocks of 256 scaled to 3 x rms "
             "(clipped), 8-bit error, beta=0.8",
    "diloco": "DiLoCo: adamw alone on each device for --inner-steps steps, then the float32 "
              "mean of the pseudo-gradients and an outer Nesterov step (--outer-lr, momentum 0.9)",
    "diloco-loco4": "DiLoCo with the pseudo-gradients averaged by loco4 (bf16 gather)",
    "diloco-loco4-quantized": "DiLoCo with the pseudo-gradients averaged by loco4 with the "
                              "quantized gather (4 bits back, its own error)",
    **{f"{m}-overlap": f"{m} with each sync run beside the next --overlap inner steps on a "
                       f"device of its own, then merged half and half (alpha 0.5)"
       for m in ("diloco", "diloco-loco4", "diloco-loco4-quantized")},
}
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
  block_size: int = 2048  # ef2-ef4, int4-noef, loco4 (loco2, loco3: their width's default)
  fixed_scale: float = 2.0 ** 17
  eval_batches: int = 16
  corpus_bytes: int = 4_000_000
  reset_interval: int = 1024  # LoCo methods: loco(reset_interval=...), 0 never resets
  inner_steps: int = 32       # DiLoCo methods: steps between two syncs
  outer_lr: float = 0.7       # DiLoCo methods: the outer Nesterov step's rate
  overlap: int = 2            # the -overlap DiLoCo methods: inner steps a sync runs beside
  alpha: float | None = None  # DiLoCo methods: a worker's own share at a merge (None: default)

  @property
  def global_batch(self) -> int:
    return self.devices * self.batch_per_device


class Corpus(NamedTuple):
  """The batches every method sees, in the same order: int32 [steps, B, L + 1] and [K, B, L + 1]."""
  train_SxBxL: np.ndarray
  eval_KxBxL: np.ndarray
  source: str


class DemoError(ValueError):
  """Bad input: printed on stderr, exit status 2."""


# --- Methods --------------------------------------------------------------------------------------

def co3_status() -> str | None:
  """None if loco_jax.co3 imports, else why it does not."""
  try:
    module = importlib.import_module("loco_jax.transforms.co3")
  except ImportError as e:
    return f"loco_jax.co3 is not importable ({e})"
  if not hasattr(module, "co3"):
    return "loco_jax.co3 has no co3()"
  return None


def available_methods() -> tuple[str, ...]:
  """METHODS, less co3-fp4 while loco_jax.co3 is missing."""
  return tuple(m for m in METHODS if m not in CO3_METHODS or co3_status() is None)


def make_compressor(method: str, config: DemoConfig = DemoConfig(),
                    axis_name: str | None = AXIS):
  """The optax transformation that averages gradients over `axis_name` for a demo method.

  Example:
    >>> compressor = make_compressor("loco4")   # loco_jax.loco(bits=4, axis_name="data")
  """
  from loco_jax import loco
  from loco_jax.transforms import baselines
  b, reset = config.block_size, config.reset_interval
  method = DILOCO_METHODS.get(method, method)
  if method == "loco4-quantized":
    return loco(bits=4, block_size=b, reset_interval=reset, axis_name=axis_name,
                gather="quantized")
  if method == "none":
    return baselines.uncompressed(axis_name)
  if method == "bf16":
    return baselines.bf16(axis_name)
  if method == "int4-noef":
    return baselines.int_quantized(4, b, axis_name)
  if method in ("ef2", "ef3", "ef4"):
    return baselines.error_feedback(int(method[2]), b, axis_name)
  if method in ("loco2", "loco3"):  # the width's own defaults (block size included)
    return loco(bits=int(method[4]), reset_interval=reset, axis_name=axis_name)
  if method == "loco4":
    return loco(bits=4, block_size=b, reset_interval=reset, axis_name=axis_name)
  if method == "loco4-entropy":
    if axis_name is None:
      raise DemoError("loco4-entropy codes what the all-to-all sends: it needs an axis_name")
    return loco(bits=4, block_size=b, reset_interval=reset, axis_name=axis_name,
                entropy_code=True, capacity_bits=ENTROPY_CAPACITY_BITS)
  if method == "loco4-fixed":
    s = config.fixed_scale
    return loco(bits=4, scale=s, error_scale=4 * s, block_size=b, reset_interval=reset,
                axis_name=axis_name)
  if method in CO3_METHODS:
    why = co3_status()
    if why:
      raise DemoError(f"method {method} is unavailable: {why}")
    fmt, gather = CO3_METHODS[method]
    return importlib.import_module("loco_jax.transforms.co3").co3(
        fmt=fmt, gamma=0.7, axis_name=axis_name,
        **({"gather": gather} if axis_name is not None else {}))
  raise DemoError(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")


def train_options(method: str, config: DemoConfig = DemoConfig()) -> dict[str, Any]:
  """`parallel.make_train_step`'s options for a demo method: DiLoCo's mode and outer step.

  Example:
    >>> sorted(train_options("diloco-loco4"))
    ['inner_steps', 'mode', 'outer_optimizer']
  """
  if method not in DILOCO_METHODS:
    return {}
  import optax
  overlap = {"overlap": config.overlap} if method.endswith("-overlap") else {}
  alpha = {} if config.alpha is None else {"alpha": config.alpha}
  return {"mode": "diloco", "inner_steps": config.inner_steps,
          "outer_optimizer": optax.sgd(config.outer_lr, momentum=0.9, nesterov=True), **overlap,
          **alpha}


# --- Devices, data, model -------------------------------------------------------------------------

PATIENT_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=86400 "
                       "--xla_cpu_collective_call_warn_stuck_timeout_seconds=3600")


def setup_devices(n: int, platform: str | None = "cpu") -> None:
  """Asks jax for `n` CPU devices (and the CPU platform) before its backend starts.

  If the backend already runs (a test, a notebook), checks that it has at least `n` devices.
  """
  import jax
  try:
    if platform and not os.environ.get("JAX_PLATFORMS"):
      jax.config.update("jax_platforms", platform)
    jax.config.update("jax_num_cpu_devices", n)
    # The simulated devices are threads of this process, so a collective can be late (a busy
    # or paused machine) but never lost: XLA's default aborts the process after 40 s.
    if "collective_call_terminate" not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + PATIENT_COLLECTIVES
                                 ).strip()
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
  from loco_jax.apps import data
  every = round(1 / fraction)
  chunks = [raw[i:i + chunk] for i in range(0, len(raw), chunk)]
  if len(chunks) < 2 * every:
    return data.split(raw, fraction)
  held = set(range(every // 2, len(chunks), every))
  return (b"".join(c for i, c in enumerate(chunks) if i not in held),
          b"".join(c for i, c in enumerate(chunks) if i in held))


def load_corpus(config: DemoConfig, data_path: str | os.PathLike | None = None) -> Corpus:
  """Train and eval batches of the stdlib sources (or of the text at `data_path`)."""
  from loco_jax.apps import data
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
  from loco_jax.apps.models import GPT, GPTConfig, gpt
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

  The non-scalar all-to-alls, all-reduces or reduce-scatters of the step (scalars carry a loss
  or a flag) of the kind of the largest one (a few numbers, such as the scales co3's coded
  gather agrees on, come first in some steps), all of them when the gradient goes leaf by leaf
  (pmean of a pytree is one all-reduce a leaf); for a method that only gathers (top-k, co3's
  whole-gradient exchange), its all-gathers.
  """
  big = [c for c in found if c.nbytes > _SCALAR_BYTES and not c.conditional]
  for ops in (("all-to-all", "all-reduce", "reduce-scatter"), ("all-gather",)):
    chosen = [c for c in big if c.op in ops]
    if chosen:
      largest = max(chosen, key=lambda c: c.nbytes).op
      return [c for c in chosen if c.op == largest]
  return []


def gradient_bits(found: Sequence[Any], n_params: int) -> float:
  """Bits per parameter of one device's gradient payload: the buffer of `gradient_collectives`
  (for an all-gather, one device's share: its result / group size)."""
  nbytes = sum(c.nbytes / (c.group_size if c.op == "all-gather" else 1)
               for c in gradient_collectives(found))
  return 8.0 * nbytes / n_params


def co3_record(states: Sequence[Any], found: Sequence[Any], n_params: int, devices: int,
               gather: str) -> dict[str, Any]:
  """What a co3 run measured beside what its compiled program sends: the coded bits a symbol
  (mean over steps and devices), the gradient slots' bits from the HLO (the capacity: what is
  sent) and the gather's (bits an element of the averaged shard), the wire bits
  co3_exchange.predicted_bits gives for those slots, overflow, extended and rejected steps, the
  bits the slots' extensions and the raw resend add on the steps that send them, and the wire
  bits a step sent on average over the run (at most: a step that took one slot's extension
  counts them all)."""
  from loco_jax import comm
  from loco_jax.transforms import co3_exchange
  last = states[-1]
  wire = comm.wire_bits_per_param(found, n_params)
  extension = comm.wire_bits_per_param([c for c in found if comm.coded.is_extension(c)],
                                       n_params, include_conditional=True)
  # An overflow step also took the extension (its stream was longer than that too).
  resend = comm.wire_bits_per_param(found, n_params, include_conditional=True) - wire - extension
  slot_bits = gradient_bits(found, n_params)
  per_shard = any(c.op == "all-to-all" for c in gradient_collectives(found))
  gathers = [c for c in found if c.op == "all-gather" and c.nbytes > _SCALAR_BYTES
             and not c.conditional]
  gather_bits = (8.0 * sum(c.nbytes / c.group_size for c in gathers) * devices / n_params
                 if per_shard else 0.0)
  return {"exchange": "all_to_all" if per_shard else "all_gather", "gather": gather,
          "coded_bits": round(float(np.mean([np.mean(s.coded_bits) for s in states])), 4),
          "slot_bits_per_param": round(slot_bits, 4),
          "gather_bits_per_element": round(gather_bits, 4),
          "predicted_wire_bits": round(co3_exchange.predicted_bits(
              devices, slot_bits, gather_bits, per_shard), 4),
          "extension_wire_bits": round(extension, 4), "resend_wire_bits": round(resend, 4),
          "overflow_steps": int(last.overflows), "extended_steps": int(last.extended),
          "rejected_steps": int(last.rejected), "steps": len(states),
          "mean_wire_bits": round(wire + (int(last.extended) * extension + int(last.overflows)
                                          * resend) / len(states), 4)}


def step_programs(*args, **kwargs):
  """Gone: the programs of an overlapped DiLoCo step take other arguments than the step."""
  raise TypeError("demo.step_programs(step, mode, outer) is gone: use "
                  "demo.lowered_programs(step, mode, state, batch), which lowers each program "
                  "and returns (lowered, share of the steps) pairs")


def lowered_programs(step: Callable, mode: str, state: Any, batch: Any) -> list[tuple[Any, float]]:
  """The programs a train step runs, lowered, each with its share of the steps: the step
  itself; DiLoCo's inner step and its syncs (and merges) in their shares (`diloco.make_step`)."""
  if mode != "diloco":
    return [(step.jitted.lower(state, batch), 1.0)]
  return step.lowered(state, batch)


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
               progress: tqdm | None = None, optimizer=None, mode: str = "ddp",
               observe: Callable[[Any, int], None] | None = None,
               **step_kwargs: Any) -> MethodResult:
  """Trains the demo model with `compressor` averaging the gradients over the devices.

  `mode` and `step_kwargs` go to `parallel.make_train_step` ("zero2" needs a compressor with
  reduce-scatter semantics; "diloco" its outer step, `train_options`); `observe(state, step)`
  is called after every step, and `progress`, a tqdm bar, advances one step at a time. The bits
  are the mean a step over the run of every program the step runs (DiLoCo: the inner step and
  each fragment's sync, in their shares of the steps).

  Example:
    >>> config = DemoConfig(steps=20)
    >>> result = run_method("loco4", make_compressor("loco4"), config, load_corpus(config))
  """
  import jax
  import jax.numpy as jnp
  from loco_jax import comm
  from loco_jax.train import parallel
  from loco_jax.apps.models import num_params

  mesh = parallel.data_mesh(config.devices, AXIS)
  _, params, loss_fn = make_model(config)
  n_params = num_params(params)
  optimizer = optimizer or make_optimizer(config)
  outer = {k: v for k, v in step_kwargs.items()
           if k in ("inner_steps", "outer_optimizer", "fragments", "overlap", "alpha")}
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode, **outer)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params,
                                  compressor=compressor, mode=mode, **step_kwargs)
  batches = corpus.train_SxBxL
  start = time.perf_counter()
  programs = []  # (compiled, its collectives, its share of the steps)
  for lowered, share in lowered_programs(step, mode, state, jnp.asarray(batches[0])):
    found = comm.collectives(lowered.as_text(dialect="hlo", debug_info=True), config.devices)
    programs.append((lowered.compile(), found, share))
  compile_s = time.perf_counter() - start
  run = step if mode == "diloco" else programs[0][0]
  mean_bits = lambda bits: sum(share * bits(found, n_params) for _, found, share in programs)
  losses, times, co3_states = [], [], []
  for i, batch in enumerate(batches):
    t0 = time.perf_counter()
    state, loss = run(state, jnp.asarray(batch))
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    if name in CO3_METHODS:  # the counters and measured bits, not the errors
      co3_states.append(jax.device_get(state.compressor_state._replace(
          error=None, scale=None)))
    if observe:
      observe(state, i + 1)
    if progress is not None:
      progress.set_postfix(loss=f"{losses[-1]:.3f}", ms_step=f"{times[-1] * 1e3:.0f}",
                           refresh=False)
      progress.update()
  final = (state.params if mode == "ddp" else
           # with overlap the global params live on the communication devices
           jax.device_put(state.params, jax.NamedSharding(mesh, jax.P())) if mode == "diloco"
           else
           parallel.unshard_params(state.params, params))
  tail = losses[-max(len(losses) // 10, 1):]
  co3 = (co3_record(co3_states, programs[0][1], n_params, config.devices, CO3_METHODS[name][1])
         if co3_states else None)
  return MethodResult(
      method=name, final_loss=float(np.mean(tail)),
      eval_loss=evaluate(loss_fn, final, corpus.eval_KxBxL, mesh),
      gradient_bits_per_param=round(mean_bits(gradient_bits), 4),
      wire_bits_per_param=(co3["mean_wire_bits"] if co3 else
                           round(mean_bits(comm.wire_bits_per_param), 4)),
      step_time_s=float(np.median(times[1:] if len(times) > 1 else times)),
      losses=losses, compile_s=compile_s,
      state_bytes_per_device=per_device_bytes(state.compressor_state),
      collectives=[c for _, found, _ in programs for c in found],
      co3=co3)


# --- Command line ---------------------------------------------------------------------------------

MAX_DEVICES = 64  # simulated CPU devices: threads of one process; XLA aborts in the hundreds
MAX_SEED = 2**63 - 1  # jax's PRNG keys take a C long


def _bounded_int(low: int, high: int | None = None, what: str = "") -> Callable[[str], int]:
  """An argparse type: an int in low..high (argparse names the flag in its message)."""
  accepted = what or (f"an integer in {low}..{high}" if high is not None else
                      "a positive integer" if low == 1 else f"an integer >= {low}")

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
    if value < low or (high is not None and value > high):
      raise argparse.ArgumentTypeError(f"expected {accepted}, got {value}")
    return value

  return parse


_positive_int = _bounded_int(1)


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
  return value


def _fraction(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
  if not 0 <= value <= 1:
    raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
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
                 help=f"comma-separated subset of {','.join(METHODS)} (default: the available ones "
                      f"of {','.join(DEFAULT_METHODS)})")
  p.add_argument("--steps", type=_positive_int, default=d.steps, help="train steps per method")
  p.add_argument("--devices", type=_bounded_int(
      1, MAX_DEVICES, f"an integer in 1..{MAX_DEVICES} (simulated CPU devices)"),
      default=d.devices, help=f"simulated CPU devices (data-parallel workers), 1..{MAX_DEVICES}")
  p.add_argument("--batch", type=_positive_int, default=d.batch_per_device,
                 help="sequences per device per step")
  p.add_argument("--seq-len", type=_positive_int, default=d.seq_len,
                 help="tokens per sequence (at most what fits in half of this machine's memory: "
                      "the attention scores grow with devices x batch x heads x seq-len^2)")
  p.add_argument("--d-model", type=_positive_int, default=d.d_model, help="model width")
  p.add_argument("--layers", type=_positive_int, default=d.n_layers, help="transformer blocks")
  p.add_argument("--heads", type=_positive_int, default=d.n_heads, help="attention heads")
  p.add_argument("--d-ff", type=_positive_int, default=None, help="MLP width (default 4 x d-model)")
  p.add_argument("--lr", type=_positive_float, default=d.lr, help="adamw learning rate")
  p.add_argument("--seed", type=_bounded_int(0, MAX_SEED, "an integer in 0..2**63-1"),
                 default=d.seed, help="model init and data order (0..2**63-1)")
  p.add_argument("--fixed-scale", type=_positive_float, default=d.fixed_scale,
                 help="loco4-fixed's global scale s (the paper: 2**17 pre-training)")
  p.add_argument("--reset-interval", type=_bounded_int(0), default=None, metavar="N",
                 help=f"LoCo methods ({', '.join(LOCO_METHODS)}): zero the error before every "
                      f"step k > 0 that is a multiple of N (0: never; default "
                      f"{d.reset_interval}); e.g. 100 shows resets in a 300-step run")
  p.add_argument("--inner-steps", type=_positive_int, default=d.inner_steps,
                 help=f"DiLoCo methods ({', '.join(DILOCO_METHODS)}): steps each device takes "
                      f"alone between two syncs")
  p.add_argument("--outer-lr", type=_positive_float, default=d.outer_lr,
                 help="DiLoCo methods: the outer Nesterov step's learning rate (momentum 0.9)")
  p.add_argument("--overlap", type=_positive_int, default=None,
                 help=f"the -overlap DiLoCo methods: inner steps each sync runs beside, on a "
                      f"second device a worker (below --inner-steps; default {d.overlap})")
  p.add_argument("--alpha", type=_fraction, default=None,
                 help="DiLoCo methods: a worker's share of its own params when a sync is merged "
                      "(default 0.5 for the -overlap methods, 0 for the others)")
  p.add_argument("--eval-batches", type=_positive_int, default=d.eval_batches,
                 help="held-out batches for the eval loss")
  p.add_argument("--data", default=None,
                 help="a text file or folder to train on (default: the stdlib's own sources)")
  p.add_argument("--out", default=None,
                 help="output folder, new or a previous demo's (default runs/demo-<timestamp>); "
                      "its outputs are replaced as one set")
  return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
  return DemoConfig(steps=args.steps, devices=args.devices, batch_per_device=args.batch,
                    seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads, d_ff=args.d_ff or 4 * args.d_model, lr=args.lr,
                    seed=args.seed, fixed_scale=args.fixed_scale, eval_batches=args.eval_batches,
                    reset_interval=DemoConfig.reset_interval if args.reset_interval is None
                    else args.reset_interval, inner_steps=args.inner_steps,
                    outer_lr=args.outer_lr,
                    overlap=DemoConfig.overlap if args.overlap is None else args.overlap,
                    alpha=args.alpha)


def _choose_methods(text: str | None) -> tuple[list[str], dict[str, str]]:
  """(methods to run, {method: why unavailable}); DemoError on unknown names."""
  why = co3_status()
  unavailable = dict.fromkeys(CO3_METHODS, why) if why else {}
  if text is None:
    return [m for m in DEFAULT_METHODS if m not in unavailable], unavailable
  chosen = [m.strip() for m in text.split(",") if m.strip()]
  unknown = [m for m in chosen if m not in METHODS]
  if unknown or not chosen:
    raise DemoError(f"unknown method {', '.join(map(repr, unknown)) or '(none given)'}; "
                    f"accepted: {', '.join(METHODS)}")
  for m in chosen:
    if m in unavailable:
      raise DemoError(f"method {m} is unavailable: {unavailable[m]}")
  return list(dict.fromkeys(chosen)), {}


def physical_memory() -> int:
  """Bytes of memory of this machine."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_memory(config: DemoConfig, memory: int) -> None:
  """DemoError naming the flag when the run would need more than half of `memory`.

  The two terms that grow without bound: the attention scores (every device of this one
  process holds batch x heads x seq_len^2 float32 a layer, about 4 such arrays with the
  backward pass) and the token batches, all made before the first step.
  """
  budget, gib = memory // 2, lambda n: f"{n / 2**30:.1f} GiB"
  per_square = config.devices * config.batch_per_device * config.n_heads * 4 * config.n_layers * 4
  attention = per_square * config.seq_len ** 2
  if attention > budget:
    raise DemoError(
        f"--seq-len {config.seq_len}: the attention scores alone would take about "
        f"{gib(attention)} ({config.devices} devices x {config.batch_per_device} sequences x "
        f"{config.n_heads} heads x seq-len^2 x 4 bytes x {config.n_layers} layers x 4 arrays), "
        f"more than half of this machine's {gib(memory)}; accepted: at most "
        f"{math.isqrt(budget // per_square)} with these --devices, --batch, --heads, --layers")
  per_step = config.global_batch * (config.seq_len + 1) * 4
  tokens = (config.steps + config.eval_batches) * per_step
  if tokens > budget:
    raise DemoError(
        f"--steps {config.steps} with --seq-len {config.seq_len}: the token batches, made up "
        f"front, would take {gib(tokens)}, more than half of this machine's {gib(memory)}; "
        f"accepted: at most {budget // per_step - config.eval_batches} steps")


def _check_config(config: DemoConfig, memory: int | None = None) -> None:
  """What the flags' types cannot check alone, before jax starts (`memory`: bytes, default
  this machine's)."""
  if config.d_model % config.n_heads:
    raise DemoError(f"--d-model {config.d_model} must be divisible by --heads {config.n_heads}")

  _check_memory(config, physical_memory() if memory is None else memory)


def _check_out(text: str | None) -> tuple[Path, Path]:
  """(--out as an absolute path, an empty staging folder beside it), or a DemoError saying why
  the demo could not write there. The folder is created (empty) if it is new."""
  out = Path(text or Path("runs") / f"demo-{datetime.datetime.now():%Y%m%d-%H%M%S}").absolute()
  shown = text or str(out)
  for folder in (out, *out.parents):
    if folder.exists() and not folder.is_dir():
      raise DemoError(f"--out {shown} exists and is a file; expected a folder" if folder == out
                      else f"--out {shown} is under {folder}, which is a file, not a folder")
    if folder.exists():
      break
  if out.is_dir():
    foreign = sorted(p.name for p in out.iterdir() if p.name not in demo_output.OUTPUTS)
    if foreign:
      raise DemoError(f"--out {shown} holds files the demo does not write ({', '.join(foreign)}"
                      f"); its outputs replace the folder as a whole: give a new or empty "
                      f"folder, or a previous demo's output folder")
    if not os.access(out, os.W_OK | os.X_OK):
      raise DemoError(f"--out {shown} is not writable")
  try:
    out.mkdir(parents=True, exist_ok=True)
    return out, files.staging_folder(out)
  except OSError as e:
    raise DemoError(f"--out {shown} is not writable: {e.strerror} ({e.filename})") from None


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the demo; returns the exit status (2 on bad input, 130 when interrupted).

  Every flag and the output folder are checked before jax starts; the outputs are written
  into a folder beside `--out` and moved into its place at once, so an interrupted or failed
  write leaves the previous outputs whole.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args = parser().parse_args(argv)
  except SystemExit as e:  # argparse: --help (0) or a usage error (2, message already printed)
    return int(e.code or 0)
  staging = None
  try:
    try:
      config = config_from_args(args)
      _check_config(config)
      methods, unavailable = _choose_methods(args.methods)
      if args.reset_interval is not None and not set(methods) & set(LOCO_METHODS):
        raise DemoError(f"--reset-interval applies to the LoCo methods ({', '.join(LOCO_METHODS)})"
                        f"; none of them is among the methods run ({', '.join(methods)})")
      overlapped = any(m.endswith("-overlap") for m in methods)
      if args.overlap is not None and not overlapped:
        raise DemoError(f"--overlap applies to the -overlap DiLoCo methods; none of them is "
                        f"among the methods run ({', '.join(methods)})")
      if args.alpha is not None and not set(methods) & set(DILOCO_METHODS):
        raise DemoError(f"--alpha applies to the DiLoCo methods; none of them is among the "
                        f"methods run ({', '.join(methods)})")
      if overlapped and config.overlap >= config.inner_steps:
        raise DemoError(f"--overlap {config.overlap} must be below --inner-steps "
                        f"{config.inner_steps}: a sync would still run when the next is due")
      if args.data is not None and not Path(args.data).exists():
        raise DemoError(f"--data {args.data}: no such file or folder; expected a text file or "
                        f"a folder of .txt/.md/.py/.rst files")
      out, staging = _check_out(args.out)
      # The -overlap methods run each sync on a second device a worker.
      setup_devices(config.devices * (2 if overlapped else 1))
      corpus = load_corpus(config, args.data)
    except (DemoError, ValueError) as e:
      print(f"loco-jax demo: error: {e}", file=sys.stderr)
      return 2
    return _train_and_write(config, methods, unavailable, corpus, out, staging)
  finally:
    if staging is not None and staging.exists():
      shutil.rmtree(staging)


def _train_and_write(config: DemoConfig, methods: list[str], unavailable: dict[str, str],
                     corpus: Corpus, out: Path, staging: Path) -> int:
  _, params, _ = make_model(config)
  from loco_jax.apps.models import num_params
  reset = ""
  if set(methods) & set(LOCO_METHODS):
    reset = (f"; LoCo's error reset every {config.reset_interval} steps" if config.reset_interval
             else "; LoCo's error never reset")
  print(
      f"loco-jax demo: {num_params(params):,}-parameter byte-level GPT on {corpus.source}, "
      f"{config.devices} devices x {config.batch_per_device} sequences x {config.seq_len} "
      f"tokens, {config.steps} steps per method, adamw lr {config.lr:g}, seed {config.seed}; "
      f"methods: {', '.join(methods)}{reset}" +
      "".join(f"\n  {m} unavailable: {why}" for m, why in unavailable.items()),
      file=sys.stderr, flush=True)
  results = []
  start = time.perf_counter()
  try:
    for i, method in enumerate(methods):
      # One bar a method on stderr: "[2/3] loco4: 40%|####      | 80/200 [..., loss=..., ...]".
      with tqdm(total=config.steps, desc=f"[{i + 1}/{len(methods)}] {method}", unit="step",
                file=sys.stderr, dynamic_ncols=True) as bar:
        results.append(run_method(method, make_compressor(method, config), config, corpus,
                                  bar, **train_options(method, config)))
  except KeyboardInterrupt:
    print("\nloco-jax demo: interrupted; nothing written", file=sys.stderr)
    return 130
  total_s = time.perf_counter() - start

  try:
    plotted = demo_output.write_outputs(
        staging, results, f"loco-jax demo: {num_params(params):,} params, {config.devices} devices")
    files.replace_folder(staging, out)
  except KeyboardInterrupt:  # held back during the renames: raised before or after them
    state = "is as it was" if staging.exists() else "holds the new outputs"
    print(f"\nloco-jax demo: interrupted while writing; {out} {state}", file=sys.stderr)
    return 130
  except OSError as e:
    print(f"loco-jax demo: error: could not write the outputs ({e}); {out} is as it was",
          file=sys.stderr)
    return 1
  print(demo_output.format_table(results, unavailable))
  text = demo_output.summary(results)
  if text:
    print(text)
  compile_s = sum(r.compile_s for r in results)
  print(f"total {demo_output.clock(total_s)} (compile {compile_s:.0f} s); wrote "
        f"{out / 'results.json'}, loss_curves.csv" +
        (", loss_curves.png" if plotted else " (no PNG: matplotlib is not installed)"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
