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


def _changes():
    """Every way a user changes a fixed temperature, each to a new value: (name, function of the likelihood)."""
    from gpytorch.constraints import GreaterThan

    def state_dict(likelihood):
        state = likelihood.state_dict()
        state["raw_temperature"] = state["raw_temperature"] + 0.7
        likelihood.load_state_dict(state)

    return [
        ("setter", lambda lik: setattr(lik, "temperature", 2.5)),
        ("initialize", lambda lik: lik.initialize(raw_temperature=torch.tensor(-1.3))),
        ("load_state_dict", state_dict),
        ("in-place write through .data", lambda lik: lik.raw_temperature.data.fill_(0.4)),
        ("a new constraint", lambda lik: lik.register_constraint("raw_temperature", GreaterThan(0.5))),
    ]


@pytest.mark.parametrize("change", _changes(), ids=lambda c: c[0])
def test_fixed_temperature_follows_every_change_of_value_or_constraint(change):
    """The number is GPyTorch's transform of the current raw value, after every kind of change (the transform
    runs only when the raw value or the constraint differ from the last call's)."""
    likelihood = SoftmaxLikelihood(3, temperature=0.8)
    assert likelihood.fixed_temperature() == pytest.approx(0.8, rel=1e-6)
    change[1](likelihood)
    expected = likelihood.raw_temperature_constraint.transform(likelihood.raw_temperature).item()
    assert abs(expected - 0.8) > 1e-3
    assert likelihood.fixed_temperature() == expected
    likelihood.learn_temperature = True  # learned: no number, the tensor with its graph is what counts
    assert likelihood.fixed_temperature() is None


@pytest.mark.parametrize("structure", ["diag_ggn", "kfac"])
@pytest.mark.parametrize("change", _changes(), ids=lambda c: c[0])
def test_structured_evidence_follows_a_changed_fixed_temperature(change, structure):
    """The one-node evidence of a curvature, evaluated before and after the likelihood's fixed temperature
    changes, against its data term, prior and log-determinant ratio evaluated separately (Σ log(s u + δ) − Σ P log δ
    on the likelihood's output scale; no cached number)."""
    from ntkgp.laplace.weight_space import compute_curvature

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,))
    likelihood = SoftmaxLikelihood(3, temperature=0.8).double()
    curvature = compute_curvature(net, x, y, likelihood, structure, prior_structure="network")
    delta = torch.tensor([1.3], dtype=torch.float64, requires_grad=True)

    def both():
        value = curvature.log_marginal_likelihood(delta, likelihood)
        expected = (curvature.data_fit(likelihood) - 0.5 * (delta * curvature.theta_sq_norms).sum()
                    - 0.5 * curvature.log_det_ratio(delta, likelihood))
        grads = [torch.autograd.grad(v, delta)[0] for v in (value, expected)]
        return value.item(), expected.item(), grads

    for _ in range(2):  # before and after the change
        value, expected, (grad, expected_grad) = both()
        assert value == pytest.approx(expected, rel=1e-11)
        assert torch.allclose(grad, expected_grad, rtol=1e-10)
        change[1](likelihood)
