"""Deprecated module: the Laplace-GGN evidence moved to :mod:`ntkgp.laplace` as
:func:`~ntkgp.laplace.laplace_log_marginal_likelihood`. The old names keep working for one release."""

from __future__ import annotations

import warnings

import torch
from gpytorch.likelihoods import Likelihood

from ..kernels import NTKKernel
from ..laplace.evidence import curvature_factor, laplace_log_marginal_likelihood, log_det_term, prior_term
from ..options import Curvature, Space

#: Deprecated: the accepted values live in :class:`ntkgp.options.Curvature` and :class:`ntkgp.options.Space`.
CURVATURES = tuple(m.value for m in Curvature)
SPACES = tuple(m.value for m in Space)

log_det_curvature = log_det_term

__all__ = ["curvature_factor", "laplace_ggn_evidence", "log_det_curvature", "prior_term"]


def laplace_ggn_evidence(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    y: torch.Tensor,
    curvature: str = "ggn",
    space: str = "auto",
) -> torch.Tensor:
    """Deprecated alias of :func:`ntkgp.laplace.laplace_log_marginal_likelihood` (same arguments)."""
    warnings.warn(
        "ntkgp.mlls.laplace_ggn_evidence is deprecated; use ntkgp.laplace.laplace_log_marginal_likelihood",
        DeprecationWarning,
        stacklevel=2,
    )
    return laplace_log_marginal_likelihood(kernel, likelihood, x, f, y, curvature, space)
