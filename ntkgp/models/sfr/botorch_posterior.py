"""``SFR.posterior``: BoTorch's ``Model.posterior`` for SFR; BoTorch is imported only when it is called."""

from __future__ import annotations

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from ...likelihoods import is_gaussian

__all__ = ["botorch_posterior"]


def select_outputs(dist: MultivariateNormal, indices: list[int], num_outputs: int) -> MultivariateNormal:
    """The joint distribution of the outputs ``indices`` (interleaved order kept), lazily indexed."""
    if num_outputs == 1 or list(indices) == list(range(num_outputs)):
        return dist
    idx = torch.as_tensor(indices, dtype=torch.long, device=dist.mean.device)
    if idx.dim() != 1 or idx.numel() == 0 or bool(((idx < 0) | (idx >= num_outputs)).any()):
        raise ValueError(f"output_indices must be distinct outputs in 0..{num_outputs - 1}, got {indices!r}")
    mean = dist.mean[..., idx]
    n = mean.shape[-2]
    rows = (torch.arange(n, device=idx.device)[:, None] * num_outputs + idx).reshape(-1)
    covariance = dist.lazy_covariance_matrix[..., rows, :][..., :, rows]
    if idx.numel() == 1:
        return MultivariateNormal(mean[..., 0], covariance)
    return MultitaskMultivariateNormal(mean, covariance, interleaved=True)


def botorch_posterior(model, X: Tensor, output_indices, observation_noise, posterior_transform, **kwargs):
    """See :meth:`ntkgp.models.sfr.SFR.posterior`."""
    try:
        from botorch.posteriors.gpytorch import GPyTorchPosterior
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("SFR.posterior needs BoTorch: pip install 'ntkgp[botorch]'") from error
    c = model.num_outputs
    indices = list(range(c)) if output_indices is None else list(output_indices)
    if isinstance(observation_noise, bool) or observation_noise is None:
        noise = None
    elif torch.is_tensor(observation_noise):
        noise = observation_noise
    else:
        raise TypeError(f"observation_noise must be a bool or a tensor, got {type(observation_noise).__name__}")
    if observation_noise is True and not is_gaussian(model.likelihood):
        raise ValueError(
            f"observation_noise=True needs a Gaussian likelihood; {type(model.likelihood).__name__} has no noise to add"
        )
    dist = model(X, **kwargs)
    if observation_noise is True:
        dist = model.likelihood(dist)
    dist = select_outputs(dist, indices, c)
    if noise is not None:
        expected = (*dist.mean.shape, 1) if len(indices) == 1 else tuple(dist.mean.shape)
        if tuple(noise.shape) not in (expected, tuple(dist.mean.shape)):
            raise ValueError(f"observation_noise must have shape {expected}, got {tuple(noise.shape)}")
        if (noise < 0).any() or not torch.isfinite(noise).all():
            raise ValueError("observation_noise must be finite and non-negative")
        diag = DiagLinearOperator(noise.to(dist.mean).reshape(*dist.mean.shape[: -2 if len(indices) > 1 else -1], -1))
        covariance = dist.lazy_covariance_matrix + diag
        dist = type(dist)(dist.mean, covariance, **({"interleaved": True} if len(indices) > 1 else {}))
    posterior = GPyTorchPosterior(dist)
    return posterior if posterior_transform is None else posterior_transform(posterior)
