"""GPyTorch means built from the trained network."""

from .linearized_mean import LinearizedNetworkMean, NetworkMean

__all__ = ["LinearizedNetworkMean", "NetworkMean"]
