"""Greedy-variance inducing inputs (pivoted Cholesky from linear_operator) against a brute-force greedy
selection on a Gram built from autograd Jacobians."""

from __future__ import annotations

import torch
from gpytorch.likelihoods import GaussianLikelihood

from ntkgp.models.sfr import SFR
from ntkgp.models.sfr.inducing_points import uniform_subset
from tests.helpers import brute_jacobian, column_groups, mlp
from tests.models.sfr.problems import DELTA, Dense, layer_labels, problem
from ntkgp.models import SFRInducingOptions


def brute_force_greedy(k: torch.Tensor, size: int) -> list[int]:
    """Repeatedly take the point of largest conditional variance diag(K − K_{·S} K_SS⁻¹ K_{S·})."""
    chosen: list[int] = []
    for _ in range(size):
        if chosen:
            s = torch.tensor(chosen)
            residual = k.diagonal() - (k[:, s] * torch.linalg.solve(k[s][:, s], k[s, :]).T).sum(1)
            residual[s] = -torch.inf
        else:
            residual = k.diagonal().clone()
        chosen.append(int(torch.argmax(residual)))
    return chosen


def test_greedy_variance_picks_the_brute_force_greedy_points():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 3, dtype=torch.float64, generator=g)
    net = mlp(3, 6, 2, depth=2, seed=4)
    with torch.no_grad():
        y = net(x) + 0.1 * torch.randn(40, 2, dtype=torch.float64, generator=g)
    from gpytorch.likelihoods import MultitaskGaussianLikelihood

    lik = MultitaskGaussianLikelihood(2, rank=0, has_global_noise=False).double()
    sfr = SFR(net, x, y, lik, num_inducing=7, prior_precision=DELTA,
              inducing=SFRInducingOptions(inducing_method="greedy_variance"))
    j, _ = brute_jacobian(net, x)
    p0 = DELTA[column_groups(net, layer_labels(net))]
    k = ((j / p0) @ j.T).view(40, 2, 40, 2).diagonal(dim1=1, dim2=3).sum(-1)  # output trace Σ_c K_cc
    expected = x[torch.tensor(brute_force_greedy(k, 7))]
    assert torch.equal(sfr.inducing_points, expected)


def test_greedy_variance_with_duplicate_candidates_still_returns_distinct_rows():
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = torch.cat([x, x])  # rank of the pool's Gram ≤ 6
    net = mlp(3, 6, 1, depth=2, seed=0)
    with torch.no_grad():
        y = net(x).squeeze(-1)
    from gpytorch.likelihoods import GaussianLikelihood

    sfr = SFR(net, x, y, GaussianLikelihood().double(), num_inducing=8,
              inducing=SFRInducingOptions(inducing_method="greedy_variance"))
    assert sfr.inducing_points.shape == (8, 3) and torch.isfinite(sfr.inducing_points).all()
    assert len({tuple(r.tolist()) for r in sfr.inducing_points}) == 6  # every distinct point, then repeats


def test_uniform_subset_is_the_bottom_k_of_seeded_keys_in_data_order():
    x = torch.arange(20, dtype=torch.float64)[:, None]
    keys = torch.rand(20, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = torch.sort(torch.topk(keys, 6, largest=False).indices).values
    for batches in ([x], list(x.split(7)), list(x.split(1))):
        subset, total = uniform_subset(batches, 6, seed=5)
        assert total == 20 and torch.equal(subset[:, 0].long(), expected)


def test_random_inducing_inputs_are_a_seeded_subset():
    net, x, y, lik, _ = problem("gaussian", 1, n=40)
    a = SFR(net, x, y, lik, num_inducing=10, inducing=SFRInducingOptions(seed=1)).inducing_points
    b = SFR(net, x, y, lik, num_inducing=10, inducing=SFRInducingOptions(seed=1)).inducing_points
    c = SFR(net, x, y, lik, num_inducing=10, inducing=SFRInducingOptions(seed=2)).inducing_points
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert all(any(torch.equal(row, xr) for xr in x) for row in a)
    assert len({tuple(r.tolist()) for r in a}) == 10


def test_greedy_variance_is_deterministic_and_covers_clusters():
    torch.manual_seed(0)
    centres = torch.tensor([[0.0, 0, 0], [6, 0, 0], [0, 6, 0], [0, 0, 6], [-6, 0, 0]], dtype=torch.float64)
    sizes = [200, 4, 4, 4, 4]
    x = torch.cat([ctr + 0.3 * torch.randn(s, 3, dtype=torch.float64) for ctr, s in zip(centres, sizes)])
    cluster = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])
    net = mlp(3, 6, 1, seed=0)
    with torch.no_grad():
        y = net(x).squeeze(-1)
    lik = GaussianLikelihood().double()
    greedy = {"inducing_method": "greedy_variance"}
    z1 = SFR(net, x, y, lik, num_inducing=6, inducing=SFRInducingOptions(seed=0, **greedy)).inducing_points
    z2 = SFR(net, x, y, lik, num_inducing=6, inducing=SFRInducingOptions(seed=5, **greedy)).inducing_points
    assert torch.equal(z1, z2)

    dense = Dense(net, x, y, "gaussian")
    k = dense.kernel(dense.j, dense.j)

    def nystrom_error(z):
        idx = torch.tensor([int(torch.nonzero((x == r).all(1))[0]) for r in z])
        q = k[:, idx] @ torch.linalg.solve(k[idx][:, idx], k[idx, :])
        return torch.trace(k - q).item(), len(set(cluster[idx].tolist()))

    greedy_err, greedy_clusters = nystrom_error(z1)
    random_errs = [nystrom_error(SFR(net, x, y, lik, num_inducing=6,
                                     inducing=SFRInducingOptions(seed=s)).inducing_points) for s in range(5)]
    assert greedy_clusters == 5
    assert all(greedy_err < err for err, _ in random_errs)
