"""fastes: Triton-kernel-optimised Evolution Strategies (and GRPO) for post-training language models."""

from .es import ES, Member, replay
from .params import linear_weights
from .shaping import SHAPINGS, shape_rewards

__version__ = "0.1.0"

__all__ = ["ES", "Member", "SHAPINGS", "linear_weights", "replay", "shape_rewards", "__version__"]
