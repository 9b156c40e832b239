"""GPyTorch models built from a trained network."""

from .ntkgp import NTKGP, ExactNTKGP, LaplaceNTKGP

__all__ = ["NTKGP", "ExactNTKGP", "LaplaceNTKGP"]
