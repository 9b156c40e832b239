"""``NTKGP.optimize_prior_precision`` and the MLL's: the δ that maximizes the Laplace-GGN evidence, against a dense
brute force (explicit GGN from autograd, ``torch.linalg.eigvalsh``); and GPyTorch's ``Adam(model.hyperparameters())``
learns no temperature unless asked."""

from __future__ import annotations

import math

import pytest
import torch

import ntkgp
from ntkgp.likelihoods import SoftmaxLikelihood
from tests.helpers import attains_optimum, mlp
from tests.posteriors.reference import dense_curvature

DTYPE = torch.float64


def problem():
    net = mlp(d_in=2, width=4, d_out=3, depth=1, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 2, dtype=DTYPE, generator=g)
    y = torch.randint(0, 3, (12,), generator=g)
    return net, x, y


def dense_evidence(net, x, y, grid: torch.Tensor) -> torch.Tensor:
    """The evidence for one δ at each grid value: explicit GGN, its eigenvalues, torch.distributions' log p."""

    def log_prob(f, t):
        return torch.distributions.Categorical(logits=f).log_prob(t.reshape(-1))

    eigenvalues = torch.linalg.eigvalsh(dense_curvature(net, x, y, log_prob, "ggn"))
    theta_sq = sum(p.detach().square().sum() for p in net.parameters())
    with torch.no_grad():
        fit = log_prob(net(x), y).sum()
    return (fit - 0.5 * grid * theta_sq + 0.5 * eigenvalues.numel() * grid.log()
            - 0.5 * (eigenvalues[None, :] + grid[:, None]).log().sum(-1))


def test_ntkgp_and_mll_optimum_match_the_dense_brute_force():
    net, x, y = problem()
    grid = torch.logspace(-3, 3, 3001, dtype=DTYPE)
    best = grid[dense_evidence(net, x, y, grid).argmax()].item()
    spacing = math.log(grid[1] / grid[0])
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(3).double(), prior_precision=5.0, prior_structure="network")
    delta = model.optimize_prior_precision(optimizer="lbfgs")
    assert abs(math.log(delta.item() / best)) <= spacing
    assert torch.equal(model.covar_module.prior_precision.detach(), delta)
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(3).double(), prior_precision=5.0, prior_structure="network")
    model.eval()
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(model.likelihood, model)
    delta = mll.optimize_prior_precision(steps=150, lr=0.1)
    # Adam: 150 steps of 0.1 in log δ from log 5 reach the optimum to within a few steps' tolerance
    assert abs(math.log(delta.item() / best)) <= 0.02
    assert not model.training  # left in the mode it was in
    coarse = torch.logspace(-2, 2, 9, dtype=DTYPE)
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(3).double(), prior_structure="network")
    chosen = model.optimize_prior_precision(optimizer="grid", grid=coarse)
    assert attains_optimum(coarse, dense_evidence(net, x, y, coarse), chosen)


def test_refused_arguments_leave_delta_unchanged():
    net, x, y = problem()
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(3).double(), prior_precision=2.0, prior_structure="network")
    for kwargs, name in (({"optimizer": "sgd"}, "optimizer"), ({"steps": 0}, "steps"),
                         ({"optimizer": "grid", "grid": [1.0, 0.0]}, "grid")):
        with pytest.raises(ValueError, match=name):
            model.optimize_prior_precision(**kwargs)
        assert model.covar_module.prior_precision.item() == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize("learn", [False, True])
def test_hyperparameters_idiom_learns_a_temperature_only_when_asked(learn):
    net, x, y = problem()
    likelihood = SoftmaxLikelihood(3, learn_temperature=learn).double() if learn else SoftmaxLikelihood(3).double()
    model = ntkgp.NTKGP(net, x, y, likelihood, prior_structure="network")
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(model.likelihood, model)
    model.train()
    optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.1)
    delta0 = model.covar_module.prior_precision.item()
    temperature0 = model.likelihood.temperature.item()
    for _ in range(3):
        optimizer.zero_grad()
        (-mll(model(x), y)).backward()
        optimizer.step()
    assert model.covar_module.prior_precision.item() != delta0
    assert model.likelihood.raw_temperature.requires_grad is learn
    moved = model.likelihood.temperature.item() != temperature0
    assert moved is learn
