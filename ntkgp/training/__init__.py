"""Learning hyperparameters during training (Algorithm 1) and selecting models by evidence."""

from .marglik_options import HyperparameterSchedule, MAPOptimization
from .marglik_training import train_marglik
from .model_selection import EvidenceRow, EvidenceTable, compare_models
from .result import MarglikResult
from .safeguards import HyperparameterWarning

__all__ = [
    "EvidenceRow",
    "EvidenceTable",
    "HyperparameterSchedule",
    "HyperparameterWarning",
    "MAPOptimization",
    "MarglikResult",
    "compare_models",
    "train_marglik",
]
