"""Learning hyperparameters during training (Algorithm 1) and selecting models by evidence."""

import warnings as _warnings

from .marglik_training import HyperparameterWarning, MarglikResult, train_marglik
from .model_selection import EvidenceRow, EvidenceTable, compare_models

__all__ = ["EvidenceRow", "EvidenceTable", "HyperparameterWarning", "MarglikResult", "compare_models", "train_marglik"]


def __getattr__(name: str):
    if name == "STRUCTURES":  # deprecated: the structures are ntkgp.options.Structure
        from ..options import Structure

        _warnings.warn("ntkgp.training.STRUCTURES is deprecated; use ntkgp.options.Structure", DeprecationWarning, stacklevel=2)
        return tuple(s.value for s in Structure)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
