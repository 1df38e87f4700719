"""Shared by the experiment scripts: device set-up, named method variants, result files."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

VARIANT_HELP = """Method variants (names used by compare.py and sweep.py):
  none | bf16                      float32 / bfloat16 all-reduce
  noef<b>[-rms<c>][-B<n>]          <b>-bit absmax blocks, no feedback (noef4 = demo int4-noef)
  ef<b>[-rms<c>][-B<n>]            classic EF, float32 error (ef4 = demo ef4); -rms<c>: loco's
                                   clipped-rms block scale at c x rms; -B: block size
  ef21-<b> | sign | topk<pct>      EF21, 1-bit sign with EF, top-k with EF (topk1 = 1%)
  loco<b>[-paper][-rms<c>][-B<n>][-b<beta>][-e<bits>|-efp32][-fixed][-q]
                                   LoCo at <b> bits from loco(bits=<b>)'s defaults (clipped-rms
                                   blocks of 256 at 2 and 3 bits; loco.defaults_for);
                                   -paper: the paper's recipe instead (absmax blocks of the
                                   demo's 2048, what loco<b> meant before those defaults);
                                   -rms<c>: top code at c x the block's rms; -B: block size;
                                   -b: beta (default 0.8); -e: error bits (default 8); -efp32:
                                   float32 error (this file's fp32_error_loco); -fixed: the
                                   demo's fixed scale; -q: the all-gather re-quantized
  co3-fp4 | co3-fp8                CO3, once loco_jax.co3 exists"""


def setup(devices: int, platform: str = "cpu", cache_dir: str | None = None) -> None:
  """Device count and platform before jax starts, and an optional persistent compile cache
  (identical steps, e.g. other seeds, then compile once)."""
  if platform != "gpu":  # JAX_PLATFORMS=gpu also asks for ROCm, which a CUDA jax refuses
    os.environ.setdefault("JAX_PLATFORMS", platform)
  import jax
  from loco_jax.apps import demo
  if platform == "cpu":
    demo.setup_devices(devices, platform=None)
  elif jax.default_backend() != platform:
    raise SystemExit(f"--platform {platform}: jax runs on {jax.default_backend()} here")
  elif jax.device_count() < devices:
    raise SystemExit(f"--devices {devices}: only {jax.device_count()} {platform} devices")
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# --- LoCo with a float32 error (not in the library: an ablation of its int8 storage) ------------

def fp32_error_loco(bits: int, beta: float, block_size: int = 2048, axis_name: str = "data",
                    scale_method: str = "absmax", clip_rms: float | None = None):
  """LoCo's update e' = beta e + (1 - beta)(h - d) with e kept in float32, on LoCo's wire (the
  `bits`-bit all-to-all of `baselines.int_quantized`); no periodic reset."""
  from loco_jax.transforms import baselines
  return baselines.error_feedback(bits, block_size, axis_name, scale_method=scale_method,
                                  clip_rms=clip_rms, beta=beta)


# --- Variants -------------------------------------------------------------------------------------

_LOCO = re.compile(r"loco(\d)((?:-paper|-rms[\d.]+|-B\d+|-b[\d.]+|-e\d|-efp32|-fixed|-q)*)$")
_BLOCKS = r"((?:-rms[\d.]+|-B\d+)*)"


def _scaling(opts: str, block_size: int) -> dict:
  """block_size, scale_method and clip_rms of a baseline's -rms<c> and -B<n> options."""
  rms, block = re.search(r"-rms([\d.]+)", opts), re.search(r"-B(\d+)", opts)
  return dict(block_size=int(block[1]) if block else block_size,
              scale_method="rms" if rms else "absmax", clip_rms=float(rms[1]) if rms else None)


def make_variant(name: str, config, axis_name: str = "data"):
  """The compressor for a variant name (see VARIANT_HELP); ValueError for an unknown one."""
  from loco_jax import loco
  from loco_jax.apps import demo
  from loco_jax.transforms import baselines
  b = config.block_size
  if name in demo.METHODS:
    return demo.make_compressor(name, config, axis_name)
  if name == "co3-fp8":
    import importlib
    return importlib.import_module("loco_jax.transforms.co3").co3(fmt="fp8", axis_name=axis_name)
  if m := re.fullmatch(r"noef(\d)" + _BLOCKS, name):
    return baselines.int_quantized(int(m[1]), axis_name=axis_name, **_scaling(m[2], b))
  if m := re.fullmatch(r"ef(\d)" + _BLOCKS, name):
    return baselines.error_feedback(int(m[1]), axis_name=axis_name, **_scaling(m[2], b))
  if m := re.fullmatch(r"ef21-(\d)", name):
    return baselines.ef21(int(m[1]), b, axis_name)
  if name == "sign":
    return baselines.sign_ef(b, axis_name)
  if m := re.fullmatch(r"topk([\d.]+)", name):
    return baselines.topk_ef(float(m[1]) / 100, axis_name)
  if m := _LOCO.fullmatch(name):
    from loco_jax.transforms import settings as loco_settings
    bits, opts = int(m[1]), m[2]
    paper = "-paper" in opts or bits not in loco_settings.BIT_WIDTH_DEFAULTS
    base = loco_settings.defaults_for(bits)
    scaling = _scaling(opts, b if paper else base["block_size"])
    if not paper and "-rms" not in opts:
      scaling.update(scale_method=base["scale_method"], clip_rms=base["clip_rms"])
    beta = float(re.search(r"-b([\d.]+)", opts)[1]) if "-b" in opts else 0.8
    if "-efp32" in opts:
      return fp32_error_loco(bits, beta, axis_name=axis_name, **scaling)
    error_bits = int(re.search(r"-e(\d)", opts)[1]) if re.search(r"-e\d", opts) else 8
    kwargs = dict(bits=bits, beta=beta, error_bits=error_bits, axis_name=axis_name,
                  gather="quantized" if "-q" in opts else "bf16", **scaling)
    if "-fixed" in opts:
      kwargs.update(scale=config.fixed_scale, error_scale=4 * config.fixed_scale,
                    scale_method=None, clip_rms=None)
    return loco(**kwargs)
  raise ValueError(f"unknown variant {name!r}\n{VARIANT_HELP}")


# --- Result files ---------------------------------------------------------------------------------

def append_jsonl(path: Path, record: dict) -> None:
  """Appends one record (one line, flushed), so that an interrupted sweep keeps what it did."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
  # Imported here: importing loco_jax imports jax, which must wait for `setup`.
  from loco_jax.train import files
  files.write_atomic(path, text)


def read_jsonl(path: Path) -> list[dict]:
  if not Path(path).exists():
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def finite_or_none(x: float) -> float | None:
  return float(x) if x is not None and math.isfinite(x) else None


def mean_std(values: Sequence[float]) -> str:
  """'m ± s' (sample std) of the finite values; n/a when none."""
  v = np.asarray([x for x in values if x is not None and math.isfinite(x)], float)
  if v.size == 0:
    return "n/a"
  if v.size == 1:
    return f"{v[0]:+.2f}"
  return f"{v.mean():+.2f} ± {v.std(ddof=1):.2f}"


def describe(config) -> str:
  """One line naming a config's model, batch and schedule."""
  return (f"d_model {config.d_model}, {config.n_layers} layers, {config.devices} devices x "
          f"{config.batch_per_device} x {config.seq_len} tokens, {config.steps} steps, "
          f"adamw lr {config.lr:g}")


def result_record(result, config, **extra: Any) -> dict:
  """A JSON record of a demo.MethodResult plus the config and `extra` fields."""
  import dataclasses
  record = result.as_json()  # non-finite losses already null
  stride = max(len(result.losses) // 100, 1)
  record.update(compile_s=result.compile_s,
                state_bytes_per_device=result.state_bytes_per_device,
                diverged=not math.isfinite(result.final_loss) or not math.isfinite(
                    result.eval_loss),
                losses=[finite_or_none(x) for x in result.losses[::stride]],
                config=dataclasses.asdict(config), **extra)
  return record


def co3_available() -> bool:
  """True once loco_jax.co3 imports (the CO3 rows and curves are skipped until then)."""
  from loco_jax.apps import demo
  return demo.co3_status() is None


@contextlib.contextmanager
def stream_lengths(record):
  """Inside, `record(to_one_device, length)` for every stream a device codes (host side)."""
  from loco_jax.comm import coded
  fill_slots = coded.fill_slots

  def counted(rows_NxB, sender, capacity, coder, skip):
    slots, lengths = fill_slots(rows_NxB, sender, capacity, coder, skip)
    for j, length in enumerate(lengths.tolist()):
      if j != skip:
        record(skip >= 0, length)
    return slots, lengths

  coded.fill_slots = counted
  try:
    yield
  finally:
    coded.fill_slots = fill_slots
