"""Learning hyperparameters during training (Algorithm 1) and selecting models by evidence."""

from .marglik_training import STRUCTURES, MarglikResult, train_marglik
from .model_selection import EvidenceRow, EvidenceTable, compare_models

__all__ = ["STRUCTURES", "EvidenceRow", "EvidenceTable", "MarglikResult", "compare_models", "train_marglik"]
