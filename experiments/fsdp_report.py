"""FSDP against ZeRO-2 on 8 simulated CPU devices: per-device memory and wire bits per step.

Compiles one train step of a 12-layer GPT (gpt.layered_model) in each setting and reads the
compiled program: `memory_analysis()` for the per-device peak (arguments + outputs - donated
aliases + temp), `comm.collectives_per_step` for the bits each device sends per parameter
(loops counted once per iteration), `comm.async_collectives` for overlap. Nothing is trained.
  python experiments/fsdp_report.py
"""

import jax
import jax.numpy as jnp
import optax

from loco_jax import comm, loco
from loco_jax.train import fsdp, parallel
from loco_jax.apps.models import gpt

N = 8
CONFIG = gpt.GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=12, n_heads=4, d_ff=64)


def measure(mode: str, compressor, **options) -> dict:
  mesh, optimizer = parallel.data_mesh(N), optax.adam(1e-3)
  model = gpt.layered_model(CONFIG)
  params = gpt.layered_params(gpt.split_model(gpt.GPT(CONFIG))[1])
  loss_fn = model
  if mode == "zero2":  # each layer its own leaves: the same shards and blocks as fsdp's
    params, loss_fn = fsdp.unstacked(params, model)
  state, specs = parallel.init_train_state(params, optimizer, mesh, compressor=compressor,
                                           mode=mode)
  step = parallel.make_train_step(loss_fn, optimizer, mesh, params, compressor=compressor,
                                  mode=mode, **options)
  batch = jnp.zeros((16, CONFIG.seq_len + 1), jnp.int32)
  compiled = step.jitted.lower(state, batch).compile()
  m = compiled.memory_analysis()
  text = compiled.as_text()
  n_params = sum(x.size for x in jax.tree.leaves(params))
  bits = {}
  for c in comm.collectives_per_step(text, N):
    bits[c.op] = bits.get(c.op, 0.0) + comm.wire_bits_per_param([c], n_params)
  return dict(peak=(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                    + m.temp_size_in_bytes),
              arguments=m.argument_size_in_bytes, temp=m.temp_size_in_bytes, bits=bits,
              overlapped=comm.async_collectives(text), n_params=n_params)


def main() -> None:
  jax.config.update("jax_num_cpu_devices", N)
  scatter = lambda: loco(axis_name="data", scatter=True)
  runs = [(mode, name, compressor, options)
          for mode in ("zero2", "fsdp")
          for name, compressor, options in [
              ("fp32 reduce-scatter, fp32 compute", parallel.reduce_scatter("data"), {}),
              ("LoCo, fp32 compute", scatter(), {}),
              ("LoCo, bf16 compute and gather", scatter(), dict(compute_dtype=jnp.bfloat16)),
              ("LoCo, int8 gather", scatter(), dict(param_gather="int8"))]]
  results = {}
  print(f"{CONFIG}, 16 sequences a step over {N} devices")
  print("| mode | gradients, params | peak bytes / device | arguments | temp | gradient "
        "exchange bits | param gather bits | async pairs with work between |")
  print("|---|---|---|---|---|---|---|---|")
  for mode, name, compressor, options in runs:
    r = results[mode, name] = measure(mode, compressor, **options)
    b = r["bits"]
    grad = b.get("all-to-all", 0.0) + b.get("reduce-scatter", 0.0)
    print(f"| {mode} | {name} | {r['peak']} | {r['arguments']} | {r['temp']} | {grad:.2f} | "
          f"{b.get('all-gather', 0.0):.2f} | {r['overlapped'] or 'none'} |")
  print(f"\n{results['fsdp', runs[0][1]]['n_params']} parameters")
  for _, name, _, _ in runs[:4]:
    ratio = results["fsdp", name]["peak"] / results["zero2", name]["peak"]
    print(f"fsdp / zero2 peak, {name}: {ratio:.3f}")


if __name__ == "__main__":
  main()
