"""GPyTorch means built from the trained network."""

from .linearised_mean import LinearisedNetworkMean, NetworkMean

__all__ = ["LinearisedNetworkMean", "NetworkMean"]
