"""The optax transformations: loco, two_hop, co3 and the baselines, with their states."""

from loco_jax.transforms.baselines import (EF21State, ErrorFeedbackState, bf16, ef21,
                                           error_feedback, int_quantized, sign_ef, topk_ef,
                                           uncompressed)
from loco_jax.transforms.co3 import Co3State, co3
from loco_jax.transforms.loco import loco
from loco_jax.transforms.loco_state import LocoState, error_by_leaf
from loco_jax.transforms.settings import defaults_for
from loco_jax.transforms.specs import state_specs
from loco_jax.transforms.two_hop import TwoHopState, two_hop

__all__ = ["Co3State", "EF21State", "ErrorFeedbackState", "LocoState", "TwoHopState", "bf16",
           "co3", "defaults_for", "ef21", "error_by_leaf", "error_feedback", "int_quantized",
           "loco", "sign_ef", "state_specs", "topk_ef", "two_hop", "uncompressed"]
