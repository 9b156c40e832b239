"""Temperature: the setter validates as the constructor does, and the documented claim that the Laplace
evidence (θ* fixed) is non-decreasing in T holds (docs/math.md, "Temperature"; docs/likelihoods.md)."""

from __future__ import annotations

import math

import pytest
import torch

from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood, hessian, log_likelihood


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, torch.tensor([1.0, 2.0]), "2", True])
def test_temperature_setter_rejects_what_the_constructor_rejects(bad):
    likelihood = SoftmaxLikelihood(3)
    before = likelihood.raw_temperature.detach().clone()
    with pytest.raises((ValueError, TypeError), match="temperature"):
        likelihood.temperature = bad
    with pytest.raises((ValueError, TypeError), match="temperature"):
        SoftmaxLikelihood(3, temperature=bad)
    assert torch.equal(likelihood.raw_temperature.detach(), before)


def test_temperature_setter_accepts_a_scalar_tensor():
    likelihood = LogisticLikelihood()
    likelihood.temperature = torch.tensor([0.25])
    assert likelihood.temperature.shape == () and likelihood.temperature.item() == pytest.approx(0.25)


def _dense_evidence(likelihood, f, y, gram, prior_term):
    """(1/T)·Σ log p − ½θᵀP0θ − ½ log|I + Λ^{1/2} K Λ^{1/2}|, with Λ^{1/2} the symmetric square root from an
    eigendecomposition of the dense block-diagonal Λ (independent of hessian_sqrt)."""
    n, c = f.shape
    lam = torch.block_diag(*hessian(likelihood, f, y))
    w, v = torch.linalg.eigh(lam)
    root = v @ torch.diag(w.clamp_min(0).sqrt()) @ v.T
    inner = torch.eye(n * c, dtype=f.dtype) + root @ gram @ root
    return log_likelihood(likelihood, f, y).sum() - prior_term - 0.5 * torch.linalg.slogdet(inner)[1]


@pytest.mark.parametrize("num_classes", [1, 3])
def test_laplace_evidence_is_non_decreasing_in_temperature(num_classes):
    torch.manual_seed(0)
    n, p = 12, 30
    c = num_classes
    jac = torch.randn(n * c, p, dtype=torch.float64)
    gram = jac @ jac.T / 2.0  # K = J P0⁻¹ Jᵀ with δ = 2
    f = 3 * torch.randn(n, c, dtype=torch.float64)
    y = torch.randint(0, 2, (n,)) if c == 1 else torch.randint(0, c, (n,))
    prior_term = torch.tensor(1.7, dtype=torch.float64)  # ½ δ ‖θ*‖², independent of T
    temperatures = torch.logspace(-2, 2, 25, dtype=torch.float64)
    values = []
    for temperature in temperatures:
        likelihood = LogisticLikelihood() if c == 1 else SoftmaxLikelihood(c)
        likelihood = likelihood.double()
        likelihood.temperature = float(temperature)
        values.append(_dense_evidence(likelihood, f, y.double() if c == 1 else y, gram, prior_term).item())
    differences = torch.tensor(values).diff()
    assert bool((differences >= -1e-10).all()), differences
    assert values[-1] > values[0] + 1.0  # strictly increasing on this case, not merely flat

    likelihood = (LogisticLikelihood(learn_temperature=True) if c == 1 else SoftmaxLikelihood(c, learn_temperature=True))
    likelihood = likelihood.double()
    evidence = _dense_evidence(likelihood, f, y.double() if c == 1 else y, gram, prior_term)
    (derivative,) = torch.autograd.grad(evidence, likelihood.raw_temperature)
    assert derivative.item() > 0
