"""fastes: Triton-kernel-optimised Evolution Strategies (and GRPO) for post-training language models."""

from .distributed import CollectiveError
from .es.optimizer import ES, Member, replay
from .es.params import linear_weights
from .es.shaping import SHAPINGS, shape_rewards
from .version import __version__

# The TRL-shaped trainers import transformers: loaded on first use, so `import fastes` stays light.
_TRAINER_NAMES = ("ESConfig", "ESTrainer", "GRPOConfig", "GRPOTrainer")


def __getattr__(name: str) -> object:
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'fastes' has no attribute {name!r}")


__all__ = [
    "CollectiveError",
    "ES",
    "ESConfig",
    "ESTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "Member",
    "SHAPINGS",
    "linear_weights",
    "replay",
    "shape_rewards",
    "__version__",
]
