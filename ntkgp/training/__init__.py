"""Learning hyperparameters during training (Algorithm 1) and selecting models by evidence."""

from .marglik_training import STRUCTURES, MarglikResult, train_marglik
from .model_selection import EvidenceRow, EvidenceTable, compare_models

__all__ = ["train_marglik", "MarglikResult", "STRUCTURES", "compare_models", "EvidenceTable", "EvidenceRow"]
