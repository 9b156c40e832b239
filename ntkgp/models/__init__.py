"""GPyTorch models built from a trained network."""

from .ntkgp import NTKGP, ExactNTKGP, LaplaceNTKGP
from .sfr import SFR, SFRInducingOptions, SFRMemoryOptions, nested_marginals

__all__ = ["NTKGP", "SFR", "ExactNTKGP", "LaplaceNTKGP", "SFRInducingOptions", "SFRMemoryOptions", "nested_marginals"]
