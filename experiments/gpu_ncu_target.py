"""A short program for `ncu`: the Pallas compress kernel and the receive-side mean on 2**26
values, a few launches each (what experiments/gpu_session.sh profiles).

  ncu --kernel-name regex:loco_ --launch-skip 2 --launch-count 2 python experiments/gpu_ncu_target.py
"""

import jax
import jax.numpy as jnp

from loco_jax import kernels

N = 1 << 26


def main() -> None:
  g = jax.random.normal(jax.random.key(0), (N,), jnp.float32)
  error, scales = jnp.zeros(N, jnp.int8), jnp.zeros(N // 2048, jnp.float32)
  step = jax.jit(lambda g, e, s: kernels.compress_step(g, e, s, implementation="pallas"))
  mean = jax.jit(lambda r, s: kernels.dequantize_mean(r, s, implementation="pallas"))
  for _ in range(4):
    out = step(g, error, scales)
    error, scales = out.error, out.error_scale
  received = jnp.broadcast_to(out.packed.reshape(1, -1)[:, : N // 16], (8, N // 16))
  peer_scales = jnp.broadcast_to(out.scales[None, : N // 16 // 1024], (8, N // 16 // 1024))
  for _ in range(4):
    jax.block_until_ready(mean(received, peer_scales))


if __name__ == "__main__":
  main()
