"""CO3: small-float conversion with a GenNorm-fitted scale, Huffman coding, decaying error feedback.

Each step, per leaf: a = g + gamma * e; every `refit_interval` steps a GenNorm fit of a sets the
leaf's scale (`co3_host`); q = Q(a) in the small float is sent as uint8 symbols; e = a - q. With
an axis the symbols cross in Huffman-coded slots (`co3_exchange`); without one they make a round
trip through the same coder on the host. A leaf with fewer than two non-zero values has the
scale max_value(fmt) / max|a|.

Finite in, finite out: a, the scales, the average and the outputs saturate. NaN output means a
skipped step: a non-finite gradient on any device, or a peer's stream that does not decode
(`rejected` counts those); every device then returns NaN and keeps its state.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loco_jax import comm
from loco_jax.codecs import fp
from loco_jax.core import layout, leaves, local_blocks, quant, trees
from loco_jax.transforms import co3_exchange, co3_host, co3_settings
from loco_jax.transforms.co3_settings import Co3Settings



class Co3State(NamedTuple):
  """CO3's state; `error`, `scale` and `coded_bits` differ per device."""
  count: jax.Array          # int32 steps taken; drives the refits
  error: optax.Updates      # float32 [size] per leaf: e = a - q
  scale: optax.Updates      # float32 [1] per leaf: the small-float scale from the last fit
  coded_bits: jax.Array     # float32 [1]: bits a symbol of this device's streams, last step
  overflows: jax.Array      # int32: steps that went raw because a stream did not fit its slot
  extended: jax.Array       # int32: steps where some stream took its slot's extension
  rejected: jax.Array       # int32: steps skipped because a peer's stream did not decode


class Converted(NamedTuple):
  """One group of leaves after Convert."""
  compensated: list         # float32 [size] per leaf: a = g + gamma * e
  scales: jax.Array         # float32 [leaves]
  symbols: list             # uint8 [size] per leaf: Q(a)


def co3(fmt: str = "fp4", gamma: float = 0.7, refit_interval: int = 100,
        entropy_code: bool = True, axis_name: layout.AxisName | None = None,
        capacity_bits: float | None = None, gather: str = "bf16", collective: str = "auto",
        specs: Any = None, gather_capacity_bits: float | None = None
        ) -> optax.GradientTransformationExtraArgs:
  """CO3's Convert, Compress, Correct as an optax transformation; averages over `axis_name`.

  With `axis_name` (inside `jax.shard_map`) every device serves 1/n of every leaf: one
  all-to-all of Huffman-coded shards, a float32 average, an all-gather of the averaged shard
  (`co3_exchange`). On few devices the all-gather of whole coded gradients sends less, and
  `collective="auto"` takes it there (`co3_exchange.predicted_bits`).

  Args:
    fmt: "fp4" ([1,2,1]) or "fp8" ([1,5,2]).
    gamma: memory decay of the error feedback, in [0, 1] (1: classic, 0: none).
    refit_interval: steps between GenNorm fits of the scales (the first step fits).
    entropy_code: Huffman-code the symbols (`codecs.huffman_deflate`); False sends them raw.
    axis_name: the mesh axis to average over, or None (local, no communication).
    capacity_bits: bits a symbol of the coded slots; a stream that does not fit sends the
      step's exchange raw (lossless, `state.overflows`). Default: slots of
      `co3_host.usual_capacity_bits(fmt)` that extend to `co3_host.default_capacity_bits(fmt)`
      on the steps that need it (`state.extended`); a given size has no extension
      (docs/results/co3.md).
    gather: how the per-shard exchange returns the averaged shards: "bf16", or "coded" (fp4
      on at most 21 devices: the exact sums of the devices' levels, which then agree on their
      scales, `co3_exchange.agree_scales`).
    collective: "auto", "all_to_all" (per shard) or "all_gather" (whole gradients).
    specs: PartitionSpecs of leaves sharded over other mesh axes (as in `loco`).
    gather_capacity_bits: bits an element of the coded gather's slots (gather="coded" only;
      default `co3_host.usual_sum_capacity_bits(n)`, extending as for `capacity_bits`).

  Returns:
    An optax.GradientTransformationExtraArgs whose state is a `Co3State`.

  Example:
    >>> opt = optax.chain(loco_jax.co3("fp4", gamma=0.7), optax.sgd(0.1))
    >>> updates, state = opt.update(grads, opt.init(params))
  """
  settings = co3_settings.resolve(fmt, gamma, refit_interval, entropy_code, axis_name,
                                  capacity_bits, gather, collective, specs, gather_capacity_bits)
  return optax.GradientTransformationExtraArgs(
      local_blocks.local_init(lambda params: init(settings, params), axis_name, specs, "co3"),
      local_blocks.local_update(lambda updates, state: update(settings, updates, state),
                                axis_name, specs, name="co3"))


def init(settings: Co3Settings, params: Any) -> Co3State:
  """The state for `params` (inside jax.shard_map when there is an axis)."""
  sizes = jax.tree.map(lambda x: x.size if leaves.compressible(x) else 0, params)
  return Co3State(
      count=jnp.zeros([], jnp.int32),
      error=jax.tree.map(lambda size: jnp.zeros((size,), jnp.float32), sizes),
      scale=jax.tree.map(lambda _: jnp.ones((1,), jnp.float32), sizes),
      coded_bits=jnp.zeros((1,), jnp.float32),
      overflows=jnp.zeros([], jnp.int32),
      extended=jnp.zeros([], jnp.int32),
      rejected=jnp.zeros([], jnp.int32))


def update(settings: Co3Settings, updates: Any, state: Co3State) -> tuple[Any, Co3State]:
  """One step: the averaged (or, without an axis, coded and decoded) updates and the state."""
  # coded_bits is per device, not a tree like the gradient: nothing of it to check.
  trees.check_state_matches("co3", updates, state._replace(coded_bits=None),
                            init(settings, updates)._replace(coded_bits=None))
  grads = leaves.split(updates, settings.axis_name)
  if not grads.sent:  # nothing to compress or send
    return updates, state._replace(count=optax.safe_increment(state.count))
  old = [grads.per_leaf(state.error), grads.per_leaf(state.scale)]
  refit = state.count % settings.refit_interval == 0
  mapped = grads.map_groups(lambda group: group_step(settings, grads, group, old, refit))
  # A peer's stream that did not decode (+inf) skips the step as a NaN gradient does.
  flags = jnp.where(mapped.flags == jnp.inf, jnp.nan, mapped.flags)
  new = grads.by_leaf({k: (s.error, s.scale) for k, s in mapped.states.items()}, old)
  done = grads.finish(mapped._replace(flags=flags), new, old, state.count)
  error, scale = done.state
  return done.update, Co3State(done.count, grads.tree(error), grads.tree(scale),
                               *_counters(settings, grads, mapped, state))


def _counters(settings: Co3Settings, grads: leaves.Leaves, mapped: leaves.Mapped,
              state: Co3State) -> tuple[jax.Array, ...]:
  """The new coded_bits, overflows, extended and rejected, from the groups' results
  (`Corrected`)."""
  taken, rejected = jnp.isfinite(mapped.flags), mapped.flags == jnp.inf
  groups = list(mapped.states.values())
  counts = jnp.stack([sum(s.overflowed for s in groups),
                      sum(s.extended for s in groups)]).astype(jnp.float32)
  if settings.axis_name is not None:  # every shard, like every device, counts them alike
    counts = grads.agree(counts)
  overflowed, extended = (taken & (counts > 0)).astype(jnp.int32)
  bits = (8.0 * sum(s.coded_bytes for s in groups) / max(sum(s.symbols for s in groups), 1)
          if settings.entropy_code else settings.fmt.bits)
  return (jnp.where(taken, bits, state.coded_bits).reshape(1).astype(jnp.float32),
          state.overflows + overflowed, state.extended + extended,
          state.rejected + rejected.astype(jnp.int32))


class Corrected(NamedTuple):
  """One group's step: its leaves' new state fields and what its exchange measured."""
  error: list               # float32 [size] per leaf of the group: e = a - q
  scale: list               # float32 [1] per leaf of the group
  overflowed: jax.Array     # float32 0 or 1: some stream did not fit its slot
  extended: jax.Array       # int32 0 or 1: some stream took its slot's extension
  coded_bytes: jax.Array    # int32: bytes of this device's streams
  symbols: int              # symbols those streams held


def convert(settings: Co3Settings, grads: list, errors: list, scales: list,
            refit: jax.Array, agree: bool = False) -> Converted:
  """Convert: a = g + gamma * e (saturating), the scales (refitted where `refit`; the same on
  every device where `agree`: `co3_exchange.agree_scales`), Q(a)."""
  compensated = [quant.saturate(g + settings.gamma * e) for g, e in zip(grads, errors)]
  new_scales = co3_host.leaf_scales(settings.fmt, compensated, jnp.concatenate(scales), refit)
  if agree:
    new_scales = co3_exchange.agree_scales(settings, new_scales)
  return Converted(compensated, new_scales, [fp.encode(a, settings.fmt, s)
                                             for a, s in zip(compensated, new_scales)])


def group_step(settings: Co3Settings, grads: leaves.Leaves, group: leaves.Group, old: list,
               refit: jax.Array) -> leaves.GroupResult:
  """Convert, exchange and correct one group of leaves; `old`: [errors, scales] per leaf."""
  errors, scales = [[f[i] for i in group.indices] for f in old]
  n = 1 if settings.axis_name is None else comm.axis_size(settings.axis_name, "co3")
  converted = convert(settings, [grads.flat(i) for i in group.indices], errors, scales, refit,
                      co3_exchange.sums_levels(settings, n))
  run = co3_exchange.local if n == 1 else co3_exchange.mean_over_axis
  exchanged = run(settings, converted.symbols, converted.scales,
                  leaves.flag(grads.finite(group.indices)))
  sent = [fp.decode(q, settings.fmt, s) for q, s in zip(converted.symbols, converted.scales)]
  new = Corrected([a - q for a, q in zip(converted.compensated, sent)],
                   [s[None] for s in converted.scales], exchanged.overflowed,
                   exchanged.extended, exchanged.coded_bytes,
                   co3_exchange.coded_symbols(settings, n, converted.symbols))
  return leaves.GroupResult(exchanged.values, exchanged.flag, new)
