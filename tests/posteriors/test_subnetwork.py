"""SubnetLaplace against dense brute force: the precision, covariance, sampler, GLM predictive and evidence over the
selected coordinates from autograd Jacobians whose columns are picked here by an index written independently
(float64, 1e-10); perturbations reach only the selected coordinates; every invalid subnetwork raises before a pass."""

from __future__ import annotations

import copy

import pytest
import torch

from ntkgp.laplace.weight_space import SubnetLaplace, laplace_posterior
from tests.helpers import assert_unchanged, mlp, reference_terms, snapshot
from tests.posteriors.reference import DTYPE, close, jacobian, likelihood_case, targets
from ntkgp.laplace import PassOptions


def problem(name: str = "softmax"):
    lik, c, log_prob = likelihood_case(name)
    net = mlp(3, 4, c, depth=1, seed=1)
    x = torch.randn(9, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    x_test = torch.randn(4, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    return lik, c, log_prob, net, x, targets(name, 9), x_test


def selected_columns(net, chosen: dict) -> torch.Tensor:
    """Flat positions among all trainable parameters of the chosen coordinates (``None``: the whole tensor)."""
    out, start = [], 0
    for name, p in net.named_parameters():
        if name in chosen:
            mask = torch.ones(p.numel(), dtype=torch.bool) if chosen[name] is None else chosen[name].reshape(-1)
            out.append(start + mask.nonzero().reshape(-1))
        start += p.numel()
    return torch.cat(out)


def masks(net):
    g = torch.Generator().manual_seed(7)
    w0 = torch.rand(net[0].weight.shape, generator=g) < 0.5
    w2 = torch.zeros(net[2].weight.shape, dtype=torch.bool)
    w2[:, 1] = True
    return {"0.weight": w0, "2.weight": w2, "2.bias": None}


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("name", ["multitask", "softmax"])
@pytest.mark.parametrize("by", ["names", "masks"])
def test_subnetwork_equals_dense_brute_force(by, name, kind):
    lik, c, log_prob, net, x, y, x_test = problem(name)
    chosen = {"0.bias": None, "2.weight": None} if by == "names" else masks(net)
    subnetwork = list(chosen) if by == "names" else chosen
    delta = torch.tensor([0.7, 2.5], dtype=DTYPE)  # one per layer
    before = snapshot(net)
    posterior = laplace_posterior(net, x, y, lik, structure=f"full_{kind}", subset="subnetwork",
                                  subnetwork=subnetwork, prior_precision=delta, options=PassOptions(batch_size=4))
    cols = selected_columns(net, chosen)
    assert posterior.num_params == cols.numel()
    jn = jacobian(net, x)[..., cols]  # (N, C, |S|)
    with torch.no_grad():
        f = net(x)
    g, lam = reference_terms(log_prob, f, y)
    if kind == "ggn":
        h = torch.einsum("ncp,ncd,ndq->pq", jn, lam, jn)
    else:
        rows = torch.einsum("nc,ncp->np", g, jn)
        h = rows.T @ rows
    layer_of = torch.cat([torch.full((p.numel(),), 0 if n.startswith("0.") else 1) for n, p in net.named_parameters()])
    delta_cols = delta[layer_of[cols]]
    precision = h + torch.diag(delta_cols)
    sigma = torch.linalg.inv(precision)
    close(posterior.dense_precision(), precision)
    close(posterior.log_det_precision(), torch.logdet(precision))
    b = posterior.sample_from(torch.eye(cols.numel(), dtype=DTYPE)).T
    close(b @ b.T, sigma)
    jt = jacobian(net, x_test)[..., cols]
    close(posterior.glm_covariance(x_test), torch.einsum("ncp,pq,ndq->ncd", jt, sigma, jt))
    root = posterior.glm_root(x_test).reshape(-1, cols.numel())
    close(root @ root.T, jt.reshape(-1, cols.numel()) @ sigma @ jt.reshape(-1, cols.numel()).T)
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])[cols]
    evidence = (log_prob(f, y).sum() - 0.5 * (delta_cols * theta.square()).sum() + 0.5 * delta_cols.log().sum()
                - 0.5 * torch.logdet(precision))
    close(posterior.log_marginal_likelihood(delta), evidence)
    close(posterior.mean(), theta)
    assert_unchanged(net, before)


def test_a_perturbation_moves_only_the_selected_coordinates():
    lik, _, _, net, x, y, x_test = problem()
    chosen = masks(net)
    posterior = SubnetLaplace(net, x, y, lik, chosen)
    eta = torch.randn(posterior.num_params, dtype=DTYPE, generator=torch.Generator().manual_seed(4))
    moved = copy.deepcopy(net)
    cols = selected_columns(net, chosen)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    flat[cols] += eta
    torch.nn.utils.vector_to_parameters(flat, moved.parameters())
    with torch.no_grad():
        close(posterior.function.forward(x_test, eta), moved(x_test))
    close(posterior.function.jvp(x_test, eta[None])[0], jacobian(net, x_test)[..., cols] @ eta)


def test_invalid_subnetworks_raise_before_a_pass():
    lik, _, _, net, x, y, _ = problem()
    bad_x = torch.randn(9, 5, dtype=DTYPE)  # a pass would fail on these inputs: each error must come first
    cases = [
        (["0.weight", "nope"], ValueError, "unknown"),
        (["0.weight", "0.weight"], ValueError, "distinct"),
        ({"0.weight": torch.ones(2, 2, dtype=torch.bool)}, ValueError, "shape"),
        ({"0.weight": torch.ones(4, 3)}, ValueError, "boolean"),
        ({"0.weight": torch.zeros(4, 3, dtype=torch.bool)}, ValueError, "no coordinate"),
        ("0.weight", TypeError, "subnetwork"),
    ]
    for subnetwork, error, match in cases:
        with pytest.raises(error, match=match):
            SubnetLaplace(net, bad_x, y, lik, subnetwork)
    frozen = copy.deepcopy(net)
    frozen[0].bias.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        SubnetLaplace(frozen, bad_x, y, lik, ["0.bias"])
    with pytest.raises(ValueError, match="subnetwork"):
        laplace_posterior(net, x, y, lik, structure="kfac", subset="subnetwork", subnetwork=["0.bias"])
    with pytest.raises(ValueError, match="subnetwork="):
        laplace_posterior(net, x, y, lik, structure="full_ggn", subset="subnetwork")
