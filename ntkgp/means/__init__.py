"""GPyTorch means built from the trained network."""

from .linearized_mean import LinearisedNetworkMean, LinearizedNetworkMean, NetworkMean

__all__ = ["LinearisedNetworkMean", "LinearizedNetworkMean", "NetworkMean"]
