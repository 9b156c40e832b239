"""Diagonal GGN / EF curvatures and the evidence they give, against dense brute-force formulas."""

from __future__ import annotations

import gpytorch
import pytest
import torch
from torch import nn

from ntkgp.laplace.weight_space import DiagonalEF, DiagonalGGN, compute_curvature
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood, gradient, hessian, log_likelihood
from ntkgp.ntk import resolve_groups
from tests.helpers import assert_unchanged, brute_jacobian, mlp, rel_err, small_cnn, snapshot

N = 7


def gaussian(noise: float = 0.3) -> gpytorch.likelihoods.GaussianLikelihood:
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = noise
    return lik


def multitask(noises=(0.2, 0.7)) -> gpytorch.likelihoods.MultitaskGaussianLikelihood:
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False).double()
    lik.task_noises = torch.tensor(noises, dtype=torch.float64)
    return lik


def case(name: str):
    """(net, x, y, likelihood) for a named case."""
    torch.manual_seed(3)
    x = torch.randn(N, 3, dtype=torch.float64)
    if name == "gaussian":
        return mlp(d_out=1), x, torch.randn(N, dtype=torch.float64), gaussian()
    if name == "multitask":
        return mlp(d_out=2), x, torch.randn(N, 2, dtype=torch.float64), multitask()
    if name == "logistic":
        return mlp(d_out=1), x, torch.randint(0, 2, (N,)).double(), LogisticLikelihood(temperature=0.7).double()
    if name == "softmax":
        return mlp(d_out=3), x, torch.randint(0, 3, (N,)), SoftmaxLikelihood(num_classes=3, temperature=1.3).double()
    if name == "cnn":
        x = torch.randn(N, 1, 6, 6, dtype=torch.float64)
        return small_cnn(c_out=2), x, torch.randint(0, 2, (N,)), SoftmaxLikelihood(num_classes=2).double()
    if name == "sequence":  # a linear layer applied at two locations per example
        net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(8, 3)).double()
        return net, torch.randn(N, 2, 3, dtype=torch.float64), torch.randint(0, 3, (N,)), SoftmaxLikelihood(3)
    if name == "shared":  # a layer called twice: its parameters take the per-example route
        return Shared(), x, torch.randint(0, 3, (N,)), SoftmaxLikelihood(num_classes=3)
    raise KeyError(name)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3).double()
        self.head = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))))


CASES = ["gaussian", "multitask", "logistic", "softmax", "cnn", "sequence", "shared"]


def brute_curvatures(net, x, y, likelihood) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense GGN ``Σ J_nᵀ Λ_n J_n`` and EF ``Σ G_nᵀ G_n`` from row-by-row autograd Jacobians."""
    jac, _ = brute_jacobian(net, x)
    f = net(x).detach()
    jn = jac.reshape(f.shape[0], f.shape[1], -1)
    ggn = torch.einsum("ncp,ncd,ndq->pq", jn, hessian(likelihood, f, y), jn)
    per_example = torch.einsum("nc,ncp->np", gradient(likelihood, f, y), jn)
    return ggn.detach(), (per_example.T @ per_example).detach()


def assert_data_fit_is_the_log_likelihood(curv, net, x, y, lik) -> None:
    """The curvature's data term (from statistics stored when it was computed) and its gradient in the
    likelihood's parameters equal those of ``log_likelihood`` at the likelihood's current values."""
    params = list(lik.parameters())
    for p in params:
        p.requires_grad_(True)
    ours = curv.data_fit(lik)
    direct = log_likelihood(lik, net(x).detach(), y).sum()
    assert rel_err(ours.detach(), direct.detach()) < 1e-12
    for a, b in zip(torch.autograd.grad(ours, params), torch.autograd.grad(direct, params)):
        assert rel_err(a, b) < 1e-12


def expanded_precision(net, delta: torch.Tensor) -> torch.Tensor:
    groups = resolve_groups(net, "layer")
    return delta[groups.column_groups()]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("structure", ["diag_ggn", "diag_ef"])
def test_diagonal_equals_brute_force_diagonal(name, structure):
    net, x, y, lik = case(name)
    before = snapshot(net)
    curv = compute_curvature(net, x, y, lik, structure, batch_size=3)
    assert_unchanged(net, before)
    assert isinstance(curv, DiagonalGGN if structure == "diag_ggn" else DiagonalEF)
    ggn, ef = brute_curvatures(net, x, y, lik)
    reference = (ggn if structure == "diag_ggn" else ef).diagonal()
    assert rel_err(curv.diagonal(lik).detach(), reference) < 1e-12
    assert_data_fit_is_the_log_likelihood(curv, net, x, y, lik)
    assert curv.num_data == N


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("structure", ["diag_ggn", "diag_ef"])
def test_log_det_and_evidence_equal_dense_formulas(name, structure):
    net, x, y, lik = case(name)
    curv = compute_curvature(net, x, y, lik, structure, batch_size=4)
    groups = resolve_groups(net, "layer")
    delta = torch.linspace(0.5, 3.0, groups.num_groups, dtype=torch.float64)
    ggn, ef = brute_curvatures(net, x, y, lik)
    h = torch.diag((ggn if structure == "diag_ggn" else ef).diagonal())
    log_det = torch.linalg.slogdet(h + torch.diag(expanded_precision(net, delta)))[1]
    assert torch.allclose(curv.log_det(delta, lik), log_det, rtol=1e-12)
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    prec = expanded_precision(net, delta)
    expected = (
        log_likelihood(lik, net(x).detach(), y).sum()
        - 0.5 * (prec * theta**2).sum()
        + 0.5 * prec.log().sum()
        - 0.5 * log_det
    )
    assert torch.allclose(curv.log_marginal_likelihood(delta, lik), expected, rtol=1e-12)
    assert torch.allclose(curv.log_marginal_likelihood(2.0, lik), curv.log_marginal_likelihood(torch.full_like(delta, 2.0), lik))


@pytest.mark.parametrize("name", ["gaussian", "multitask", "logistic", "softmax"])
@pytest.mark.parametrize("structure", ["diag_ggn", "diag_ef"])
def test_new_likelihood_hyperparameters_without_recomputation(name, structure):
    """After a change of noise or temperature the stored curvature equals a brute force at the new value."""
    net, x, y, lik = case(name)
    curv = compute_curvature(net, x, y, lik, structure)
    if name == "gaussian":
        lik.noise = 0.05
    elif name == "multitask":
        lik.task_noises = torch.tensor([0.9, 0.1], dtype=torch.float64)
    else:
        lik.temperature = 0.4
    ggn, ef = brute_curvatures(net, x, y, lik)
    reference = (ggn if structure == "diag_ggn" else ef).diagonal()
    assert rel_err(curv.diagonal(lik).detach(), reference) < 1e-12
    assert_data_fit_is_the_log_likelihood(curv, net, x, y, lik)


def finite_difference(fn, value: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    grads = torch.zeros_like(value)
    for i in range(value.numel()):
        step = torch.zeros_like(value)
        step.view(-1)[i] = eps
        grads.view(-1)[i] = (fn(value + step) - fn(value - step)) / (2 * eps)
    return grads


@pytest.mark.parametrize("name", ["gaussian", "multitask", "softmax"])
@pytest.mark.parametrize("structure", ["diag_ggn", "diag_ef"])
def test_gradients_match_finite_differences(name, structure):
    net, x, y, lik = case(name)
    curv = compute_curvature(net, x, y, lik, structure)
    groups = resolve_groups(net, "layer")
    delta = torch.linspace(0.5, 3.0, groups.num_groups, dtype=torch.float64).requires_grad_(True)
    (grad,) = torch.autograd.grad(curv.log_marginal_likelihood(delta, lik), delta)
    fd = finite_difference(lambda d: curv.log_marginal_likelihood(d, lik).detach(), delta.detach())
    assert torch.allclose(grad, fd, rtol=1e-6, atol=1e-8)
    raw_name = {"gaussian": "noise_covar.raw_noise", "multitask": "raw_task_noises"}.get(name, "raw_temperature")
    raw = dict(lik.named_parameters())[raw_name]
    raw.requires_grad_(True)
    (grad,) = torch.autograd.grad(curv.log_marginal_likelihood(delta.detach(), lik), raw)

    def evidence_at(value):
        with torch.no_grad():
            old = raw.clone()
            raw.copy_(value)
            out = curv.log_marginal_likelihood(delta.detach(), lik)
            raw.copy_(old)
        return out

    fd = finite_difference(evidence_at, raw.detach().clone())
    assert torch.allclose(grad, fd, rtol=1e-6, atol=1e-8)


def test_batches_from_an_iterable_equal_tensor_input():
    net, x, y, lik = case("softmax")
    loader = list(zip(x.split(2), y.split(2)))
    a = compute_curvature(net, x, y, lik, "diag_ggn", batch_size=5)
    b = compute_curvature(net, loader, None, lik, "diag_ggn", progress=True)
    assert torch.allclose(a.diagonal(lik), b.diagonal(lik), rtol=1e-13)
    assert torch.allclose(a.log_marginal_likelihood(1.0, lik), b.log_marginal_likelihood(1.0, lik), rtol=1e-13)


def test_the_full_structure_is_the_dense_ggn_whose_diagonal_the_diagonal_structure_holds():
    """compute_curvature's "full_ggn" is the dense weight-space GGN (per-example vector-Jacobian products); its
    diagonal is the diagonal GGN of the layer-feature route."""
    net, x, y, lik = case("softmax")
    full = compute_curvature(net, x, y, lik, "full_ggn")
    diagonal = compute_curvature(net, x, y, lik, "diag_ggn")
    assert full.structure == "full_ggn"
    assert torch.allclose(full.dense(lik).diagonal(), diagonal.diagonal(lik), rtol=1e-12)


def test_invalid_arguments_raise():
    net, x, y, lik = case("softmax")
    with pytest.raises(ValueError, match="structure"):
        compute_curvature(net, x, y, lik, "unknown")
    curv = compute_curvature(net, x, y, lik, "diag_ef")
    with pytest.raises(ValueError, match="shape"):
        curv.log_det(torch.ones(7, dtype=torch.float64), lik)
    with pytest.raises(ValueError, match="positive"):
        curv.log_det(-1.0, lik)
    g = curv.groups.num_groups
    for bad in (float("nan"), float("inf"), -2.0):  # tensors of the curvature's dtype and shape
        delta = torch.ones(g, dtype=torch.float64, requires_grad=True).clone()
        with torch.no_grad():
            delta[-1] = bad
        with pytest.raises(ValueError, match="positive"):
            curv.log_marginal_likelihood(delta, lik)
    with pytest.raises(ValueError, match="output scale"):
        curv.log_det(1.0, multitask())
    cnn = small_cnn().train()
    with pytest.raises(ValueError, match="training mode"):
        compute_curvature(cnn, torch.randn(2, 1, 6, 6, dtype=torch.float64), torch.tensor([0, 1]),
                          SoftmaxLikelihood(num_classes=2), "diag_ggn")
