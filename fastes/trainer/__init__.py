"""The TRL-shaped face: ESTrainer and GRPOTrainer (`trainers`) with their configs ESConfig and GRPOConfig
(`configs`, field for field TRL's GRPOConfig where they share a meaning), built on the run layer.
`fastes.ESTrainer` and the other three names load this package on first use.
"""

from .configs import ESConfig, GRPOConfig
from .trainers import ESTrainer, GRPOTrainer

__all__ = ["ESConfig", "ESTrainer", "GRPOConfig", "GRPOTrainer"]
