"""The samplers η ~ N(0, Σ) against their closed form at the Monte Carlo rate.

Fixed seeds; tolerance 5 standard errors per entry: |mean_p| < 5 √(Σ_pp / S) and
|Ĉ_pq − Σ_pq| < 5 √((Σ_pq² + Σ_pp Σ_qq) / S) for Ĉ = (1/S) Σ_s η_s η_sᵀ (the mean is known to be 0).
The exact check of each sampler's linear map (B Bᵀ = Σ to 1e-10) is in test_full_laplace / test_structured_laplace.
"""

from __future__ import annotations

import pytest
import torch

from ntkgp.laplace.weight_space import laplace_posterior
from tests.helpers import mlp
from tests.posteriors.reference import DTYPE, likelihood_case, targets

NUM_SAMPLES = 20000


def assert_mc_rate(draws: torch.Tensor, sigma: torch.Tensor, mean: torch.Tensor | None = None) -> None:
    """``draws`` ``(S, P)`` have mean ``mean`` (default 0) and covariance ``sigma`` within 5 standard errors."""
    s = draws.shape[0]
    centred = draws if mean is None else draws - mean
    var = sigma.diagonal()
    assert (centred.mean(0).abs() < 5 * (var / s).sqrt()).all()
    empirical = centred.T @ centred / s
    standard_error = ((sigma.square() + var[:, None] * var[None, :]) / s).sqrt()
    assert ((empirical - sigma).abs() < 5 * standard_error).all()


@pytest.mark.parametrize(
    "structure,subset", [("full_ggn", "all"), ("kfac", "all"), ("diag_ef", "all"), ("full_ggn", "last_layer")]
)
def test_posterior_samples_converge_to_the_covariance(structure, subset):
    lik, c, _ = likelihood_case("softmax")
    net = mlp(3, 4, c, depth=1, seed=1)
    x = torch.randn(12, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    posterior = laplace_posterior(
        net,
        x,
        targets("softmax", 12),
        lik,
        structure=structure,
        subset=subset,
        prior_precision=torch.tensor([0.5, 2.0], dtype=DTYPE) if subset == "all" else 0.5,
    )
    draws = posterior.sample(NUM_SAMPLES, generator=torch.Generator().manual_seed(11))
    assert draws.shape == (NUM_SAMPLES, posterior.num_params)
    assert_mc_rate(draws, posterior.dense_covariance())
    again = posterior.sample(NUM_SAMPLES, generator=torch.Generator().manual_seed(11))
    assert torch.equal(draws, again)
