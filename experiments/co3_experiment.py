"""CO3 experiment: GenNorm fits, Huffman bits, loss against bits; fp4/fp8 against float32 SGD."""

#   python experiments/co3_experiment.py                 # default run (see docs/results/co3.md)
#   python experiments/co3_experiment.py --quick --out /tmp/co3
#
# Two tasks, three methods each, every method on the same data, initialisation and worker split:
#   ts   the teacher-student Gaussian setting of the CO3 paper: x ~ N(0, I), labels the argmax of
#        a random tanh teacher (loco_jax.apps.models.teacher_student_data), a ReLU MLP student trained
#        with plain SGD at a constant learning rate, as in the paper;
#   gpt  the demo's byte-level GPT (smaller) on the Python standard library sources, with the
#        demo's optimizer (adamw with warm-up).
# Methods: sgd (float32 average, `baselines.uncompressed`), co3-fp4 and co3-fp8 (`loco_jax.co3`,
# gamma 0.7, Huffman coding on). Workers are simulated CPU devices: the library's data-parallel
# train step (`parallel.make_train_step`) runs under `jax.shard_map`, so each worker codes its
# own gradient, the coded buffers are all-gathered and every worker decodes and averages them.
#
# Every `--record-every` steps, on worker 0's next local gradient g, per weight matrix: the fitted
# GenNorm beta and the W2 distances to the fitted Normal, Laplace and GenNorm (`gennorm.validate`)
# of all its values and of its non-zero values; for CO3 also the fit of a = g + gamma e (what CO3
# fits and quantizes), CO3's scale in use, and, at the scale CO3's rule gives for that fit, the
# GenNorm model's entropy of a's symbols and their empirical entropy. Every step: the train loss
# and the measured Huffman bits per parameter (`Co3State.coded_bits`, mean over workers).
# Outputs in --out: results.json, table.md, loss_vs_step.png, loss_vs_bits.png,
# beta_per_layer.png, w2.png.

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from loco_jax.train import files  # noqa: E402

METHODS = ("sgd", "co3-fp4", "co3-fp8")
TASKS = ("ts", "gpt")
TASK_NAMES = {"ts": "teacher-student MLP (SGD)", "gpt": "byte-level GPT (adamw)"}
AXIS = "data"
UNCOMPRESSED_BITS = 32.0
RUN_KEYS = ("task", "method", "seed", "n_params", "steps", "workers", "final_train_loss",
            "eval_loss", "eval_accuracy", "bits_per_entry", "uplink_mbit_per_worker",
            "wire_bits_per_entry", "overflows", "step_time_s", "compile_s", "losses", "bits",
            "records")
SUMMARY_KEYS = ("task", "method", "seeds", "final_train_loss", "eval_loss", "eval_accuracy",
                "bits_per_entry", "compression", "uplink_mbit_per_worker",
                "wire_bits_per_entry", "entropy_model_minus_empirical", "eval_loss_vs_sgd",
                "accuracy_vs_sgd", "gennorm_best_fraction", "w2_gennorm_over_normal",
                "w2_laplace_over_normal", "gennorm_best_fraction_all", "overflows")


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that fixes a run; the defaults are the recorded configuration."""
  steps: int = 800              # teacher-student SGD steps
  gpt_steps: int = 200
  workers: int = 4
  seeds: tuple[int, ...] = (0,)
  record_every: int = 50
  gamma: float = 0.7
  refit_interval: int = 50      # steps between CO3's GenNorm refits (library default 100)
  validate_samples: int = 10_000  # values per matrix that gennorm.validate fits
  # teacher-student
  in_dim: int = 32
  teacher_hidden: int = 64
  classes: int = 10
  hidden: tuple[int, ...] = (128, 128)
  n_train: int = 20_000
  n_eval: int = 4_000
  batch_per_worker: int = 32
  lr: float = 0.1
  # gpt
  gpt_d_model: int = 64
  gpt_layers: int = 2
  gpt_seq_len: int = 64
  gpt_batch_per_worker: int = 8
  gpt_lr: float = 2e-3
  gpt_eval_batches: int = 4
  corpus_bytes: int = 1_000_000


QUICK = dict(steps=30, gpt_steps=0, workers=2, record_every=10, refit_interval=10,
             validate_samples=2_000, hidden=(32, 32), n_train=2_000, n_eval=500,
             batch_per_worker=16, gpt_d_model=32, gpt_layers=1, gpt_seq_len=32,
             gpt_batch_per_worker=2, gpt_eval_batches=1, corpus_bytes=100_000)


class Task(NamedTuple):
  """One training problem: params, loss, optimizer, the global batch of a step, evaluation."""
  name: str
  params: Any
  loss_fn: Callable[[Any, Any], Any]
  optimizer: Any
  steps: int
  batch: Callable[[int], Any]              # step -> global batch (leading axis = examples)
  evaluate: Callable[[Any, Any], dict]     # (params, mesh) -> {"eval_loss", "eval_accuracy"}
  grad_fn: Callable[[Any, Any], Any]       # jitted gradient of loss_fn (compiled once per task)


# --- Tasks ----------------------------------------------------------------------------------------

def teacher_student_task(config: Config, seed: int) -> Task:
  """Gaussian inputs, a random tanh teacher's argmax as the label, an MLP student, plain SGD."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from loco_jax.apps.models import MLP, mlp, teacher_student_data

  n = config.n_train + config.n_eval
  x_NxI, y_N = teacher_student_data(jax.random.key(seed), n, config.in_dim, config.classes,
                                    config.teacher_hidden, task="classification")
  x_NxI, y_N = np.asarray(x_NxI), np.asarray(y_N)
  train = slice(0, config.n_train)
  x_eval, y_eval = x_NxI[config.n_train:], y_N[config.n_train:]
  graphdef, params = mlp.split_model(
      MLP(config.in_dim, config.hidden, config.classes, nnx.Rngs(seed + 1)))
  batch_size = config.workers * config.batch_per_worker
  rows_SxB = np.random.default_rng(seed).integers(0, config.n_train,
                                                  (config.steps + 1, batch_size))
  x_train, y_train = x_NxI[train], y_N[train]

  @jax.jit
  def eval_fn(p):
    logits = nnx.merge(graphdef, p)(x_eval)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_eval).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y_eval)

  def evaluate(p, mesh) -> dict:
    del mesh
    loss, accuracy = eval_fn(p)
    return {"eval_loss": float(loss), "eval_accuracy": float(accuracy)}

  loss_fn = lambda p, b: mlp.apply_loss(graphdef, p, b)
  return Task("ts", params, loss_fn, optax.sgd(config.lr), config.steps,
              lambda t: (x_train[rows_SxB[t]], y_train[rows_SxB[t]]), evaluate,
              jax.jit(jax.grad(loss_fn)))


def gpt_task(config: Config, seed: int) -> Task:
  """The demo's GPT, data and optimizer (adamw with warm-up), at this experiment's size."""
  import jax
  from loco_jax.apps import demo
  demo_config = demo.DemoConfig(
      steps=config.gpt_steps + 1, devices=config.workers,
      batch_per_device=config.gpt_batch_per_worker, seq_len=config.gpt_seq_len,
      d_model=config.gpt_d_model, n_layers=config.gpt_layers, n_heads=4,
      d_ff=4 * config.gpt_d_model, lr=config.gpt_lr, seed=seed,
      eval_batches=config.gpt_eval_batches, corpus_bytes=config.corpus_bytes)
  corpus = demo.load_corpus(demo_config)
  _, params, loss_fn = demo.make_model(demo_config)

  def evaluate(p, mesh) -> dict:
    return {"eval_loss": demo.evaluate(loss_fn, p, corpus.eval_KxBxL, mesh),
            "eval_accuracy": None}

  return Task("gpt", params, loss_fn, demo.make_optimizer(demo_config), config.gpt_steps,
              lambda t: corpus.train_SxBxL[t], evaluate, jax.jit(jax.grad(loss_fn)))


# --- Measuring ------------------------------------------------------------------------------------

def make_compressor(method: str, config: Config):
  """The gradient average of a method over the workers: float32, or CO3 in fp4 / fp8."""
  from loco_jax import co3
  from loco_jax.transforms import baselines
  if method == "sgd":
    return baselines.uncompressed(AXIS)
  if method in ("co3-fp4", "co3-fp8"):
    return co3(method[4:], gamma=config.gamma, refit_interval=config.refit_interval,
               entropy_code=True, axis_name=AXIS)
  raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def leaf_name(path: tuple) -> str:
  """'blocks/0/fc1/kernel' from a jax key path."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def by_name(tree: Any) -> dict[str, np.ndarray]:
  """Every leaf of a pytree as numpy, keyed by its path name."""
  import jax
  return {leaf_name(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def matrices(tree: Any) -> dict[str, np.ndarray]:
  """The leaves with two or more axes (kernels, embeddings): the 'layers' whose fit we track."""
  return {name: leaf for name, leaf in by_name(tree).items() if leaf.ndim >= 2}


def _finite(x: Any) -> Any:
  """Floats as JSON: non-finite -> None."""
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(x) else None
  return x


def _fit_report(values: np.ndarray, samples: int) -> dict | None:
  """gennorm.validate of one array: beta, alpha, and W2 to Normal, Laplace, GenNorm (or None)."""
  from loco_jax.codecs import gennorm
  report = gennorm.validate(values, max_samples=samples)
  return {k: _finite(v) for k, v in report[""].items()} if report else None


def _fits(values: np.ndarray, samples: int) -> dict:
  """Fits of all the values and of the non-zero ones: exact zeros (a ReLU unit dead on the whole
  batch, an embedding row of an absent token) are an atom that drives the GenNorm likelihood to
  beta -> 0 (gennorm.BETA_RANGE's floor, 0.05), whatever the other values look like."""
  values = values.reshape(-1)
  nonzero = values[values != 0]
  zero_fraction = 1.0 - nonzero.size / max(values.size, 1)
  everything = _fit_report(values, samples)
  return {"zero_fraction": zero_fraction, "all": everything,
          "nonzero": everything if zero_fraction == 0 else _fit_report(nonzero, samples)}


def record(task: Task, method: str, config: Config, state: Any, batch: Any) -> dict:
  """Fits of worker 0's next local gradient g per matrix, and for CO3 of a = g + gamma e, the
  values CO3 itself fits and codes (with its scale, and the entropies of a's symbols)."""
  import jax
  from loco_jax.apps import huffman
  from loco_jax.codecs import fp, gennorm
  from loco_jax.transforms.co3_settings import FORMATS
  from loco_jax.transforms.co3_host import SATURATION_QUANTILE, fitted_scale
  shard = jax.tree.map(lambda x: x[: len(x) // config.workers], batch)
  grads = matrices(task.grad_fn(state.params, shard))
  cs = state.compressor_state
  is_co3 = hasattr(cs, "coded_bits")
  if is_co3:
    fmt = FORMATS[method[4:]]
    errors, scales = by_name(cs.error), by_name(cs.scale)  # worker w's: [w * size:(w+1) * size]
  layers = {}
  for name, g in grads.items():
    entry = {"size": int(g.size), **_fits(g, config.validate_samples)}
    if is_co3:
      a = g.reshape(-1).astype(np.float32) + np.float32(config.gamma) * errors[name][: g.size]
      entry["scale"] = _finite(float(scales[name][0]))  # in use since CO3's last refit
      try:
        fit = gennorm.fit(a[:: max(1, a.size // config.validate_samples)])
      except ValueError:
        fit = None
      if fit:
        entry["compensated"] = {"beta": fit.beta, "alpha": fit.alpha,
                                "zero_fraction": float(np.mean(a == 0))}
        # CO3's rule for a fresh fit of a: the fitted scale, capped so that at most 1% saturate.
        tail = float(np.quantile(np.abs(a), SATURATION_QUANTILE))
        scale = min(fitted_scale(fmt, fit.beta, fit.alpha),
                    fp.max_value(fmt) / tail if tail > 0 else math.inf)
        entry["scale_fit"] = _finite(scale)
      if fit and math.isfinite(scale) and scale > 0:
        symbols = np.asarray(fp.encode(a, fmt, scale))
        entry["entropy_empirical"] = huffman.entropy_bits(symbols)
        entry["entropy_model"] = _finite(gennorm.entropy_bits(fmt, fit.beta, fit.alpha, scale))
    layers[name] = entry
  return layers


def train(task: Task, method: str, config: Config, seed: int, log: Callable[[str], None]) -> dict:
  """Trains `task` with `method` averaging the workers' gradients; returns the run's record."""
  import jax
  import jax.numpy as jnp
  from loco_jax import comm
  from loco_jax.train import parallel
  from loco_jax.apps.models import num_params

  mesh = parallel.data_mesh(config.workers, AXIS)
  compressor = make_compressor(method, config)
  state, specs = parallel.init_train_state(task.params, task.optimizer, mesh,
                                           compressor=compressor)
  step = parallel.make_train_step(task.loss_fn, task.optimizer, mesh, task.params,
                                  compressor=compressor)
  n_params = num_params(task.params)
  # Lowered once: the collectives it runs (the library's HLO accounting), then compiled.
  start = time.perf_counter()
  lowered = step.jitted.lower(state, jax.tree.map(jnp.asarray, task.batch(0)))
  found = comm.collectives(lowered.as_text(dialect="hlo"), config.workers)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  wire_always = comm.wire_bits_per_param(found, n_params)
  wire_overflow = comm.wire_bits_per_param(found, n_params, include_conditional=True) - wire_always
  losses, bits, wire, records, times, overflows = [], [], [], [], [], 0
  for t in range(task.steps + 1):
    batch = task.batch(t)
    if t % config.record_every == 0 or t == task.steps:
      layers = record(task, method, config, state, batch)
      records.append({"step": t, "layers": layers,
                      "coded_bits": bits[-1] if bits else None})
    if t == task.steps:
      break
    t0 = time.perf_counter()
    state, loss = compiled(state, jax.tree.map(jnp.asarray, batch))
    cs = state.compressor_state
    bits.append(float(np.mean(np.asarray(cs.coded_bits))) if hasattr(cs, "coded_bits")
                else UNCOMPRESSED_BITS)
    overflowed = int(cs.overflows) - overflows if hasattr(cs, "overflows") else 0
    overflows += overflowed
    wire.append(wire_always + overflowed * wire_overflow)
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
    if (t + 1) % max(task.steps // 4, 1) == 0:
      log(f"  {task.name} {method} seed {seed}: step {t + 1}/{task.steps} loss {losses[-1]:.4f} "
          f"bits {bits[-1]:.2f}")
  tail = losses[-max(len(losses) // 10, 1):]
  return {
      "task": task.name, "method": method, "seed": seed, "n_params": n_params,
      "steps": task.steps, "workers": config.workers,
      "final_train_loss": _finite(float(np.mean(tail))),
      **{k: _finite(v) for k, v in task.evaluate(state.params, mesh).items()},
      "bits_per_entry": float(np.mean(bits)),
      "uplink_mbit_per_worker": float(np.sum(bits)) * n_params / 1e6,
      "wire_bits_per_entry": float(np.mean(wire)),
      "overflows": overflows,
      "step_time_s": float(np.median(times)),
      "compile_s": compile_s,
      "losses": [_finite(x) for x in losses], "bits": bits, "records": records,
  }


# --- Summaries ------------------------------------------------------------------------------------

def w2_stats(run: dict, which: str = "nonzero") -> dict:
  """Over every (record, matrix) of worker 0's gradient (`which` values: "all" or "nonzero"):
  how often GenNorm has the lowest W2, and the median W2 of GenNorm and Laplace relative to
  the Normal's."""
  best, g_over_n, l_over_n = [], [], []
  for rec in run["records"]:
    for layer in rec["layers"].values():
      fit = layer[which]
      if not fit or not fit["w2_normal"] or fit["w2_gennorm"] is None:
        continue
      best.append(fit["w2_gennorm"] <= min(fit["w2_normal"], fit["w2_laplace"]))
      g_over_n.append(fit["w2_gennorm"] / fit["w2_normal"])
      l_over_n.append(fit["w2_laplace"] / fit["w2_normal"])
  median = lambda v: float(np.median(v)) if v else None
  return {"gennorm_best_fraction": float(np.mean(best)) if best else None,
          "w2_gennorm_over_normal": median(g_over_n), "w2_laplace_over_normal": median(l_over_n)}


def entropy_gap(run: dict) -> float | None:
  """Median over (record, matrix) of CO3's symbols: the GenNorm model's entropy (fitted beta,
  alpha and CO3's scale) minus the empirical entropy, in bits per entry (where beta >= 0.35,
  the range CO3's scale rule is fitted for)."""
  gaps = [layer["entropy_model"] - layer["entropy_empirical"]
          for rec in run["records"] for layer in rec["layers"].values()
          if layer.get("entropy_model") is not None and "entropy_empirical" in layer
          and layer["compensated"]["beta"] >= 0.35]
  return float(np.median(gaps)) if gaps else None


def _mean(values: Sequence[Any]) -> float | None:
  v = [x for x in values if x is not None and math.isfinite(x)]
  return float(np.mean(v)) if v else None


def summarize(runs: Sequence[dict]) -> list[dict]:
  """One row per (task, method): means over seeds, and the change against sgd."""
  rows = []
  for task in TASKS:
    for method in METHODS:
      chosen = [r for r in runs if r["task"] == task and r["method"] == method]
      if not chosen:
        continue
      row = {"task": task, "method": method, "seeds": [r["seed"] for r in chosen]}
      for key in ("final_train_loss", "eval_loss", "eval_accuracy", "bits_per_entry",
                  "uplink_mbit_per_worker", "wire_bits_per_entry"):
        row[key] = _mean([r[key] for r in chosen])
      row["compression"] = UNCOMPRESSED_BITS / row["bits_per_entry"]
      stats = [w2_stats(r) for r in chosen]
      for key in ("gennorm_best_fraction", "w2_gennorm_over_normal", "w2_laplace_over_normal"):
        row[key] = _mean([s[key] for s in stats])
      row["gennorm_best_fraction_all"] = _mean([w2_stats(r, "all")["gennorm_best_fraction"]
                                                for r in chosen])
      row["entropy_model_minus_empirical"] = _mean([entropy_gap(r) for r in chosen])
      row["overflows"] = int(sum(r["overflows"] for r in chosen))
      rows.append(row)
  for row in rows:
    base = next((r for r in rows if r["task"] == row["task"] and r["method"] == "sgd"), None)
    ok = lambda k: base and row[k] is not None and base[k] is not None
    row["eval_loss_vs_sgd"] = (100 * (row["eval_loss"] / base["eval_loss"] - 1)
                               if ok("eval_loss") else None)
    row["accuracy_vs_sgd"] = (100 * (row["eval_accuracy"] - base["eval_accuracy"])
                              if ok("eval_accuracy") else None)
  return rows


def beta_table(runs: Sequence[dict]) -> list[dict]:
  """Per (task, method, matrix) of the first seed: the fitted beta of worker 0's gradient at the
  first and last record (all values, and the non-zero ones), its zero fraction at the last, the
  beta of CO3's a = g + gamma e at the last, and the mean W2 (non-zero values) over the records."""
  rows = []
  for run in runs:
    if run["seed"] != runs[0]["seed"]:
      continue
    for name in run["records"][0]["layers"]:
      layers = [rec["layers"][name] for rec in run["records"]]
      fits = [layer["nonzero"] for layer in layers if layer["nonzero"]]
      if not fits or not layers[0]["all"] or not layers[-1]["all"]:
        continue
      comp = layers[-1].get("compensated")
      rows.append({
          "task": run["task"], "method": run["method"], "layer": name,
          "beta_first": layers[0]["all"]["beta"], "beta_last": layers[-1]["all"]["beta"],
          "beta_nonzero_first": fits[0]["beta"], "beta_nonzero_last": fits[-1]["beta"],
          "zero_fraction_last": layers[-1]["zero_fraction"],
          "beta_compensated_last": comp["beta"] if comp else None,
          **{k: _mean([f[k] for f in fits]) for k in ("w2_normal", "w2_laplace", "w2_gennorm")},
      })
  return rows


def _fmt(v: Any, spec: str, none: str = "-") -> str:
  return none if v is None else format(v, spec)


def format_tables(summary: Sequence[dict], betas: Sequence[dict]) -> str:
  """The markdown tables: methods (loss, accuracy, bits), and GenNorm fits per layer."""
  lines = ["| task | method | final train loss | eval loss | vs sgd | eval acc | vs sgd (pts) | "
           "bits/entry | compression | uplink Mbit/worker | wire bits/entry | GenNorm best W2 "
           "(non-zero / all) | H model - H symbols | overflow steps |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in summary:
    lines.append(
        f"| {r['task']} | {r['method']} | {_fmt(r['final_train_loss'], '.4f')} | "
        f"{_fmt(r['eval_loss'], '.4f')} | {_fmt(r['eval_loss_vs_sgd'], '+.2f')}% | "
        f"{_fmt(r['eval_accuracy'], '.4f')} | {_fmt(r['accuracy_vs_sgd'], '+.2f')} | "
        f"{r['bits_per_entry']:.3f} | {r['compression']:.1f}x | "
        f"{r['uplink_mbit_per_worker']:.1f} | {r['wire_bits_per_entry']:.2f} | "
        f"{_fmt(r['gennorm_best_fraction'], '.0%')} / "
        f"{_fmt(r['gennorm_best_fraction_all'], '.0%')} | "
        f"{_fmt(r['entropy_model_minus_empirical'], '+.3f')} | {r['overflows']} |")
  lines += ["", "bits/entry: measured Huffman bits per parameter of one worker's upload, mean "
            "over steps and workers (sgd: float32); uplink: their sum over the run. wire "
            "bits/entry: what one worker sends per parameter and step in this implementation's "
            "collectives, from the step's HLO (ring all-reduce 2(n-1)/n; CO3's fixed-capacity "
            "coded buffer, plus the raw symbols on an overflow step). H model - H symbols: "
            "median entropy of the fitted GenNorm's symbols minus the empirical entropy of CO3's "
            "symbols (matrices with beta >= 0.35). GenNorm best W2: share of (record, matrix) "
            "pairs of worker 0's gradient where the fitted GenNorm is closer in W2 than the "
            "fitted Normal and Laplace, fitting the non-zero values / all values (exact zeros "
            "drive the GenNorm fit to its floor beta = 0.05).", "",
            "| task | method | layer | beta first | beta last | beta first (non-zero) | "
            "beta last (non-zero) | zeros last | beta of g+gamma*e last | W2 normal | "
            "W2 laplace | W2 gennorm |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in betas:
    lines.append(
        f"| {r['task']} | {r['method']} | {r['layer']} | {r['beta_first']:.3f} | "
        f"{r['beta_last']:.3f} | {r['beta_nonzero_first']:.3f} | "
        f"{r['beta_nonzero_last']:.3f} | {r['zero_fraction_last']:.1%} | "
        f"{_fmt(r['beta_compensated_last'], '.3f')} | "
        f"{_fmt(r['w2_normal'], '.3e')} | {_fmt(r['w2_laplace'], '.3e')} | "
        f"{_fmt(r['w2_gennorm'], '.3e')} |")
  return "\n".join(lines) + "\n"


# --- Files and plots ------------------------------------------------------------------------------

def _smooth(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  k = max(len(y) // 25, 1)
  return np.arange(k, len(y) + 1), np.convolve(y, np.ones(k) / k, mode="valid")


def plot(runs: Sequence[dict], out: Path) -> list[str]:
  """loss_vs_step.png, loss_vs_bits.png, beta_per_layer.png, w2.png (first seed); their names."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  seed = runs[0]["seed"]
  runs = [r for r in runs if r["seed"] == seed]
  tasks = [t for t in TASKS if any(r["task"] == t for r in runs)]
  written = []

  for kind in ("step", "bits"):
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), dpi=100, squeeze=False)
    for ax, task in zip(axes[0], tasks):
      for r in (r for r in runs if r["task"] == task):
        y = np.asarray([np.nan if v is None else v for v in r["losses"]])
        x, s = _smooth(y)
        if kind == "bits":
          cumulative = np.cumsum(r["bits"]) * r["n_params"]
          ax.plot(cumulative[x - 1], s, label=f"{r['method']} ({r['bits_per_entry']:.2f} b/entry)")
          ax.set_xscale("log")
          ax.set_xlabel("cumulative Huffman-coded uplink bits per worker")
        else:
          ax.plot(x, s, label=f"{r['method']} (eval {r['eval_loss']:.3f})")
          ax.set_xlabel("step")
      ax.set_ylabel("train loss (moving average)")
      ax.set_title(TASK_NAMES[task])
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"loss_vs_{kind}.png"
    files.save_figure_atomic(fig, out / name)
    plt.close(fig)
    written.append(name)

  methods = [m for m in METHODS if any(r["method"] == m for r in runs)]
  fig, axes = plt.subplots(len(tasks), len(methods), figsize=(4.6 * len(methods),
                                                            3.6 * len(tasks)),
                           dpi=100, squeeze=False, sharey="row")
  for i, task in enumerate(tasks):
    for j, method in enumerate(methods):
      ax = axes[i][j]
      run = next((r for r in runs if r["task"] == task and r["method"] == method), None)
      if run is None:
        continue
      colors = plt.get_cmap("tab20").colors
      for k, name in enumerate(run["records"][0]["layers"]):
        recs = [rec for rec in run["records"] if rec["layers"][name]["nonzero"]]
        steps = [rec["step"] for rec in recs]
        betas = [rec["layers"][name]["nonzero"]["beta"] for rec in recs]
        ax.plot(steps, betas, marker=".", label=name, color=colors[k % len(colors)])
      ax.axhline(2.0, color="k", lw=0.6, ls=":")
      ax.axhline(1.0, color="k", lw=0.6, ls="--")
      ax.set_title(f"{task} {method}: GenNorm beta of g (non-zero values)", fontsize=9)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
      if j == 0:
        ax.set_ylabel("fitted beta (2 normal, 1 Laplace)")
    axes[i][0].legend(fontsize=6)
  fig.tight_layout()
  files.save_figure_atomic(fig, out / "beta_per_layer.png")
  plt.close(fig)
  written.append("beta_per_layer.png")

  fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.6 * len(tasks)), dpi=100, squeeze=False)
  for i, task in enumerate(tasks):
    run = next(r for r in runs if r["task"] == task and r["method"] == methods[0])
    names = list(run["records"][0]["layers"])
    for ax, name in zip(axes[i], (names[0], names[-1])):
      recs = [rec for rec in run["records"] if rec["layers"][name]["nonzero"]]
      for dist in ("normal", "laplace", "gennorm"):
        ax.plot([rec["step"] for rec in recs],
                [rec["layers"][name]["nonzero"][f"w2_{dist}"] for rec in recs], marker=".",
                label=dist)
      ax.set_yscale("log")
      ax.set_title(f"{task} {run['method']} {name}: W2 (non-zero values)", fontsize=9)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
  fig.tight_layout()
  files.save_figure_atomic(fig, out / "w2.png")
  plt.close(fig)
  written.append("w2.png")
  return written


# --- Command line ---------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--steps", type=int, default=None,
                 help=f"teacher-student steps (default {Config.steps}; --quick {QUICK['steps']})")
  p.add_argument("--gpt-steps", type=int, default=None,
                 help=f"GPT steps (default {Config.gpt_steps}; 0 skips the GPT, as --quick does)")
  p.add_argument("--workers", type=int, default=None,
                 help=f"simulated CPU devices, one worker each (default {Config.workers})")
  p.add_argument("--seeds", "--seed", default=None,
                 help="comma-separated seeds, e.g. 0,1,2 (default 0)")
  p.add_argument("--record-every", type=int, default=None,
                 help=f"steps between GenNorm fits (default {Config.record_every})")
  p.add_argument("--lr", type=float, default=None, help=f"teacher-student SGD lr ({Config.lr})")
  p.add_argument("--quick", action="store_true", help="tiny sizes, for the test (seconds)")
  p.add_argument("--out", default=None, help="output folder (default runs/co3-<timestamp>)")
  return p


def config_from_args(args: argparse.Namespace) -> Config:
  """The defaults (or QUICK), then every option given on the command line."""
  config = Config(**(QUICK if args.quick else {}))
  given = {"steps": args.steps, "gpt_steps": args.gpt_steps, "workers": args.workers,
           "record_every": args.record_every, "lr": args.lr}
  config = dataclasses.replace(config, **{k: v for k, v in given.items() if v is not None})
  if args.seeds is not None:
    try:
      seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    except ValueError:
      raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
      raise ValueError("--seeds names no seed")
    config = dataclasses.replace(config, seeds=seeds)
  for name in ("steps", "workers", "record_every"):
    if getattr(config, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
  if config.gpt_steps < 0:
    raise ValueError(f"--gpt-steps must be >= 0, got {config.gpt_steps}")
  return config


def main(argv: Sequence[str] | None = None) -> int:
  """Runs every (task, seed, method); writes results.json, table.md and the PNGs."""
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser().parse_args(argv)
  try:
    config = config_from_args(args)
  except ValueError as e:
    print(f"co3_experiment: error: {e}", file=sys.stderr)
    return 2
  from loco_jax.apps import demo
  try:
    demo.setup_devices(config.workers)  # jax_num_cpu_devices, before any device is used
  except ValueError as e:
    print(f"co3_experiment: error: {e}", file=sys.stderr)
    return 2
  import jax

  out = Path(args.out or Path("runs") / f"co3-{datetime.datetime.now():%Y%m%d-%H%M%S}")
  out.mkdir(parents=True, exist_ok=True)
  log = lambda text: print(text, file=sys.stderr, flush=True)
  command = "python experiments/co3_experiment.py " + " ".join(argv)
  log(f"co3_experiment: {command.strip()} -> {out}")
  start = time.perf_counter()
  runs = []
  for seed in config.seeds:
    builders = [teacher_student_task] + ([gpt_task] if config.gpt_steps else [])
    for build in builders:
      task = build(config, seed)
      for method in METHODS:
        runs.append(train(task, method, config, seed, log))
        r = runs[-1]
        log(f"{task.name} {method} seed {seed}: train {r['final_train_loss']:.4f} eval "
            f"{r['eval_loss']:.4f} bits/entry {r['bits_per_entry']:.3f} "
            f"({r['step_time_s'] * 1e3:.0f} ms/step)")
  summary = summarize(runs)
  betas = beta_table(runs)
  runtime = time.perf_counter() - start
  results = {"command": command.strip(), "config": dataclasses.asdict(config),
             "jax_version": jax.__version__, "runtime_s": runtime,
             "summary": summary, "beta_table": betas, "runs": runs}
  files.write_atomic(out / "results.json", json.dumps(results, indent=1, allow_nan=False) + "\n")
  tables = format_tables(summary, betas)
  files.write_atomic(out / "table.md", tables)
  pngs = plot(runs, out)
  print(tables)
  print(f"runtime {runtime:.0f} s; wrote {out}/results.json, table.md, {', '.join(pngs)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
