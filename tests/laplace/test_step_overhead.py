"""The shortcuts of a hyperparameter step: the finite check by one sum, the stacked group norms, one module walk
per network state; each against an independent computation, and the caches still following every change."""

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood
from torch import nn

import ntkgp
from ntkgp.linalg import all_finite
from ntkgp.ntk import NTKEngine


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_all_finite_matches_isfinite(dtype):
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    cases = [torch.randn(50, 3, generator=g).to(dtype), torch.full((4,), big, dtype=dtype),  # the sum overflows
             torch.zeros(0, dtype=dtype)]
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(7, 5, generator=g).to(dtype)
        t[3, 2] = bad
        cases.append(t)
    t = torch.ones(6, dtype=dtype)
    t[1], t[4] = float("inf"), -float("inf")  # inf + (-inf): NaN, still caught
    cases.append(t)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(torch.arange(5))  # integers are always finite


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double().eval()


@pytest.mark.parametrize("structure", ["network", "layer", "parameter"])
def test_group_sq_norms_against_a_loop(structure):
    net = _net()
    engine = NTKEngine(net, prior_structure=structure)
    expected = torch.zeros(engine.num_groups, dtype=torch.float64)
    for p, g in zip(engine.parameters(), engine.groups.group_of):
        expected[g] += (p.detach() ** 2).sum()
    assert torch.allclose(engine.group_sq_norms(), expected, rtol=1e-14, atol=0)


def test_network_state_follows_data_writes_and_frozen_parameters():
    net = _net()
    net[2].requires_grad_(False)  # layer 2 held fixed (this test's own network)
    engine = NTKEngine(net, prior_structure="network")
    before = [t.clone() for t in engine.network_state()]
    with torch.no_grad():
        net[2].weight.data.mul_(2)  # a frozen parameter: enters through the fingerprint
    after = engine.network_state()
    assert not torch.equal(before[-1], after[-1])
    assert all(torch.equal(a, b) for a, b in zip(before[:-1], after[:-1]))
    net[0].weight.data.add_(1)  # a covered parameter: the tensor itself
    assert not torch.equal(before[0], engine.network_state()[0])


def test_one_delta_step_follows_weight_and_noise_changes():
    """The eigen route of an MLL step (checked once per call) against the Cholesky route after each change."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1)).double().eval()
    x, y = torch.randn(30, 2, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    lik = GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=2.0, prior_structure="network")
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    model.train()
    for change in (lambda: None, lambda: net[0].weight.data.mul_(1.5), lambda: setattr(lik, "noise", 0.3),
                   lambda: setattr(model.covar_module, "prior_precision", torch.tensor([0.7]))):
        change()
        value = mll(model(x), y) * x.shape[0]
        exact = model.log_marginal_likelihood(method="cholesky")
        assert torch.allclose(value, exact, rtol=1e-10, atol=0)


@pytest.mark.parametrize("k", [1, 3])
def test_block_sandwich_against_the_dense_block_diagonal(k):
    from ntkgp.linalg import block_sandwich

    g = torch.Generator().manual_seed(2)
    n, c = 5, 3
    blocks = torch.randn(n, c, k, generator=g, dtype=torch.float64)
    dense = torch.block_diag(*blocks)  # (N·C, N·k), the L the function never forms
    a = torch.randn(2, n * c, n * c, generator=g, dtype=torch.float64)  # not symmetric: no assumption
    expected = dense.T @ a @ dense
    assert torch.allclose(block_sandwich(blocks, a), expected, rtol=1e-12, atol=1e-12)
    sym = a @ a.transpose(-1, -2)
    assert torch.allclose(block_sandwich(blocks, sym, symmetric=True), dense.T @ sym @ dense, rtol=1e-12, atol=1e-12)
    assert block_sandwich(blocks, sym, symmetric=True).is_contiguous()


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn", "full_ggn"])
def test_the_quick_delta_check_refuses_what_the_full_one_refuses(structure):
    from ntkgp.laplace.weight_space import compute_curvature

    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double().eval()
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    lik = GaussianLikelihood().double()
    curvature = compute_curvature(net, x, y, lik, structure, prior_structure="layer")
    good = torch.tensor([0.5, 2.0], dtype=torch.float64)
    value = curvature.log_marginal_likelihood(good, lik)
    # the full conversion (a list) takes another code path to the same float64 formula: equal up to the rounding
    # of each, |Δ| ≤ ε (|log p(y|f)| + prior + ½ log|A| + P(P+1) κ(A)) per path. The three terms are summed with
    # prior, log|A| ≥ 0, so their sizes are at most |log p(y|f)| + |value|; the Cholesky factor of the whitened
    # precision A (P × P; or its eigendecomposition) is backward stable with ‖ΔA‖ ≤ (P+1) ε ‖A‖, so log|A| moves by
    # |tr(A⁻¹ΔA)| ≤ P(P+1) ε κ(A)
    root = good[curvature.column_groups].rsqrt()
    spectrum = 1 + torch.linalg.eigvalsh(root[:, None] * curvature.dense(lik).detach() * root)  # of A = I + D H D
    size = spectrum.numel()
    scale = curvature.data_fit(lik).abs().detach() + value.abs().detach()
    tolerance = 2 * torch.finfo(torch.float64).eps * (scale + size * (size + 1) * spectrum[-1] / spectrum[0])
    assert (value - curvature.log_marginal_likelihood(good.tolist(), lik)).abs() <= tolerance
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        delta = good.clone()
        delta[1] = bad
        with pytest.raises(ValueError, match="prior_precision"):
            curvature.log_marginal_likelihood(delta, lik)
