"""Small flax nnx models for the demo and experiments: a byte-level GPT and a tiny MLP."""
from typing import Any

import jax
from flax import nnx

from loco_jax.apps.models import gpt, mlp
from loco_jax.apps.models.gpt import GPT, GPTConfig
from loco_jax.apps.models.mlp import MLP, teacher_student_data

__all__ = ["GPT", "GPTConfig", "MLP", "gpt", "mlp", "num_params", "teacher_student_data"]


def num_params(model_or_params: nnx.Module | Any) -> int:
  """Number of scalar parameters in an nnx module or a params pytree.

  Example:
    >>> num_params(GPT())
    470784
  """
  if isinstance(model_or_params, nnx.Module):
    model_or_params = nnx.state(model_or_params, nnx.Param)
  return sum(int(leaf.size) for leaf in jax.tree.leaves(model_or_params))
