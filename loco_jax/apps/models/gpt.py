"""A small byte-level GPT in flax nnx, with a pure-functional loss for jax.grad."""
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Params = Any  # nested dict of jax arrays, as returned by `split_model`


class GPTConfig(NamedTuple):
  """Sizes of a `GPT`; the defaults give 470,784 parameters.

  Example:
    >>> GPTConfig(d_model=64, n_layers=1).n_heads
    4
  """
  vocab_size: int = 256
  seq_len: int = 64       # longest input the position table covers
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  d_ff: int = 512


def _check_config(config: GPTConfig) -> None:
  for name, value in config._asdict().items():
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}.")
  if config.d_model % config.n_heads:
    raise ValueError(
        f"GPTConfig.d_model ({config.d_model}) must be divisible by n_heads "
        f"({config.n_heads}).")


def _dense(d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, kernel_init=nnx.initializers.normal(std), rngs=rngs)


class CausalSelfAttention(nnx.Module):
  """Multi-head self-attention where position i sees positions <= i."""

  def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
    d, out_std = config.d_model, 0.02 / math.sqrt(2 * config.n_layers)
    self.n_heads = config.n_heads
    self.qkv = _dense(d, 3 * d, 0.02, rngs)
    self.out = _dense(d, d, out_std, rngs)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    B, L, D = x_BxLxD.shape
    H = self.n_heads
    qkv_BxLx3xHxK = self.qkv(x_BxLxD).reshape(B, L, 3, H, D // H)
    q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
    scores_BxHxLxL = jnp.einsum("bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxHxK)
    scores_BxHxLxL = scores_BxHxLxL / math.sqrt(D // H)
    causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
    scores_BxHxLxL = jnp.where(causal_LxL, scores_BxHxLxL, jnp.finfo(scores_BxHxLxL.dtype).min)
    probs_BxHxLxL = jax.nn.softmax(scores_BxHxLxL.astype(jnp.float32), axis=-1)
    y_BxLxHxK = jnp.einsum("bhqs,bshk->bqhk", probs_BxHxLxL.astype(v_BxLxHxK.dtype), v_BxLxHxK)
    return self.out(y_BxLxHxK.reshape(B, L, D))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
    d, out_std = config.d_model, 0.02 / math.sqrt(2 * config.n_layers)
    self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
    self.attn = CausalSelfAttention(config, rngs)
    self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
    self.fc1 = _dense(d, config.d_ff, 0.02, rngs)
    self.fc2 = _dense(config.d_ff, d, out_std, rngs)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    x_BxLxD = x_BxLxD + self.attn(self.ln1(x_BxLxD))
    h_BxLxF = jax.nn.gelu(self.fc1(self.ln2(x_BxLxD)))
    return x_BxLxD + self.fc2(h_BxLxF)


class GPT(nnx.Module):
  """Decoder-only transformer over byte tokens: embeddings, causal blocks, logits head.

  All state is `nnx.Param` (no dropout, no rng state), so `split_model` yields only
  trainable parameters.

  Example:
    >>> model = GPT(GPTConfig(d_model=32, n_layers=1, d_ff=64))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
  """

  def __init__(self, config: GPTConfig = GPTConfig(), rngs: nnx.Rngs | None = None):
    _check_config(config)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    self.config = config
    init = nnx.initializers.normal(0.02)
    self.tok_emb = nnx.Embed(config.vocab_size, config.d_model, embedding_init=init, rngs=rngs)
    self.pos_emb = nnx.Param(init(rngs.params(), (config.seq_len, config.d_model)))
    self.blocks = nnx.List([Block(config, rngs) for _ in range(config.n_layers)])
    self.ln_f = nnx.LayerNorm(config.d_model, epsilon=1e-5, rngs=rngs)
    self.head = _dense(config.d_model, config.vocab_size, 0.02, rngs)

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    """Returns float32 logits [B, L, vocab_size] for int tokens [B, L], L <= seq_len."""
    if tokens_BxL.ndim != 2:
      raise ValueError(f"GPT expects int tokens of shape [batch, length], got shape "
                       f"{tokens_BxL.shape}.")
    L = tokens_BxL.shape[1]
    if L > self.config.seq_len:
      raise ValueError(f"GPT input length {L} exceeds config.seq_len={self.config.seq_len}; "
                       f"accepted lengths are 1..{self.config.seq_len}.")
    x_BxLxD = self.tok_emb(tokens_BxL) + self.pos_emb[:L]
    for block in self.blocks:
      x_BxLxD = block(x_BxLxD)
    return self.head(self.ln_f(x_BxLxD)).astype(jnp.float32)


def loss_fn(model: GPT, batch_BxL1: jax.Array) -> jax.Array:
  """Mean next-token cross entropy; inputs batch[:, :-1], targets batch[:, 1:].

  Example:
    >>> round(float(loss_fn(GPT(), jnp.zeros((8, 65), jnp.int32))), 1)  # ln(256) = 5.55
    5.5
  """
  if batch_BxL1.ndim != 2 or batch_BxL1.shape[1] < 2:
    raise ValueError(f"batch must be int tokens of shape [batch, length + 1] with length >= 1, "
                     f"got shape {batch_BxL1.shape}.")
  logits_BxLxV = model(batch_BxL1[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch_BxL1[:, 1:]).mean()


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, Params]:
  """Splits a model into a static graphdef and a params pytree (nested dict of arrays).

  Example:
    >>> graphdef, params = split_model(GPT())
    >>> params["pos_emb"].shape
    (64, 128)
  """
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def apply_loss(graphdef: nnx.GraphDef, params: Params, batch_BxL1: jax.Array) -> jax.Array:
  """`loss_fn` of the model rebuilt from `split_model`'s output; pure, so jit/grad/shard_map safe.

  Example:
    >>> graphdef, params = split_model(GPT())
    >>> batch = jnp.zeros((8, 65), jnp.int32)
    >>> loss_and_grads = jax.jit(jax.value_and_grad(lambda p: apply_loss(graphdef, p, batch)))
    >>> loss, grads = loss_and_grads(params)
  """
  return loss_fn(nnx.merge(graphdef, params), batch_BxL1)


def layered_params(params: Params) -> "fsdp.Layered":
  """`split_model`'s params as `fsdp.Layered`: embed (tok_emb, pos_emb), the blocks stacked on
  a leading layer axis, head (ln_f, head); for `parallel` mode="fsdp" with `layered_model`.

  Example:
    >>> layered = layered_params(split_model(GPT())[1])
    >>> layered.blocks["fc1"]["kernel"].shape   # [n_layers, d_model, d_ff]
    (2, 128, 512)
  """
  from loco_jax.train import fsdp
  blocks = [params["blocks"][i] for i in sorted(params["blocks"])]
  return fsdp.Layered({"tok_emb": params["tok_emb"], "pos_emb": params["pos_emb"]},
                      jax.tree.map(lambda *layers: jnp.stack(layers), *blocks),
                      {"ln_f": params["ln_f"], "head": params["head"]})


def layered_model(config: GPTConfig = GPTConfig()) -> "fsdp.LayeredModel":
  """`loss_fn` of a `GPT(config)` as embed / block / head over `layered_params`' params.

  Example:
    >>> from loco_jax.train import fsdp
    >>> graphdef, params = split_model(GPT())
    >>> batch = jnp.zeros((8, 65), jnp.int32)
    >>> loss = fsdp.layered_loss(layered_model())(layered_params(params), batch)
    >>> bool(jnp.allclose(loss, apply_loss(graphdef, params, batch), rtol=1e-5))
    True
  """
  from loco_jax.train import fsdp
  _check_config(config)
  abstract = nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0)))
  graphdef = lambda module: nnx.split(module)[0]
  tok_emb, block, ln_f, head = (graphdef(m) for m in (abstract.tok_emb, abstract.blocks[0],
                                                      abstract.ln_f, abstract.head))

  def embed(p, batch_BxL1: jax.Array) -> jax.Array:
    if batch_BxL1.ndim != 2 or not 2 <= batch_BxL1.shape[1] <= config.seq_len + 1:
      raise ValueError(f"batch must be int tokens of shape [batch, length + 1] with length in "
                       f"1..{config.seq_len}, got shape {batch_BxL1.shape}.")
    tokens_BxL = batch_BxL1[:, :-1]
    return nnx.merge(tok_emb, p["tok_emb"])(tokens_BxL) + p["pos_emb"][: tokens_BxL.shape[1]]

  def run_block(p, x_BxLxD: jax.Array) -> jax.Array:
    return nnx.merge(block, p)(x_BxLxD)

  def loss(p, x_BxLxD: jax.Array, batch_BxL1: jax.Array) -> jax.Array:
    logits_BxLxV = nnx.merge(head, p["head"])(nnx.merge(ln_f, p["ln_f"])(x_BxLxD))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV.astype(jnp.float32), batch_BxL1[:, 1:]).mean()

  return fsdp.LayeredModel(embed, run_block, loss)
