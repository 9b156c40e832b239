"""KFAC against Kronecker factors built by hand from per-example layer inputs and output gradients, and
against the exact GGN block for one example."""

from __future__ import annotations

import gpytorch
import pytest
import torch
from torch import nn

from ntkgp.laplace.weight_space import KroneckerGGN, compute_curvature
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood, hessian
from ntkgp.ntk import resolve_groups
from ntkgp.laplace.ggn.data_pass import DataPass
from tests.helpers import assert_unchanged, brute_jacobian, mlp, reference_log_prob, reference_terms, rel_err, small_cnn, snapshot


def likelihood(name: str):
    if name == "gaussian":
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.3
        return lik, 1
    if name == "multitask":
        lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False).double()
        lik.task_noises = torch.tensor([0.2, 0.7], dtype=torch.float64)
        return lik, 2
    if name == "logistic":
        return LogisticLikelihood(temperature=0.7).double(), 1
    return SoftmaxLikelihood(num_classes=3, temperature=1.3).double(), 3


def targets(name: str, n: int) -> torch.Tensor:
    torch.manual_seed(5)
    return {
        "gaussian": lambda: torch.randn(n, dtype=torch.float64),
        "multitask": lambda: torch.randn(n, 2, dtype=torch.float64),
        "logistic": lambda: torch.randint(0, 2, (n,)).double(),
        "softmax": lambda: torch.randint(0, 3, (n,)),
    }[name]()


def lambda_root(lik, f, y) -> torch.Tensor:
    """A symmetric square root of Λ_n by eigendecomposition, ``(N, C, C)``."""
    evals, evecs = torch.linalg.eigh(hessian(lik, f, y).detach())
    return evecs @ torch.diag_embed(evals.clamp_min(0).sqrt()) @ evecs.mT


def block_loss(f_n: torch.Tensor, root_n: torch.Tensor, m: int) -> torch.Tensor:
    return f_n @ root_n[:, m]


def mlp_factors(net: nn.Sequential, x, y, lik) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, G) per Linear layer: A = Σ ā āᵀ, G = (1/N) Σ_n Σ_m Γ_nm Γ_nmᵀ, one example and one column at a time."""
    n = x.shape[0]
    f = net(x).detach()
    root = lambda_root(lik, f, y)
    linears = [m for m in net if isinstance(m, nn.Linear)]
    a_sum = [0.0] * len(linears)
    g_sum = [0.0] * len(linears)
    for i in range(n):
        h, inputs, outputs = x[i : i + 1], [], []
        for layer in net:
            if isinstance(layer, nn.Linear):
                inputs.append(torch.cat([h.detach()[0], torch.ones(1, dtype=h.dtype)]))
                h = layer(h)
                outputs.append(h)
            else:
                h = layer(h)
        for m in range(f.shape[1]):
            grads = torch.autograd.grad(block_loss(h[0], root[i], m), outputs, retain_graph=True)
            for l, g in enumerate(grads):
                g_sum[l] = g_sum[l] + torch.outer(g[0], g[0])
        for l, a in enumerate(inputs):
            a_sum[l] = a_sum[l] + torch.outer(a, a)
    return [(a, g / n) for a, g in zip(a_sum, g_sum)]


def output_factor(block, curv: KroneckerGGN, lik) -> torch.Tensor:
    return torch.einsum("k,kij->ij", curv.scale(lik), block.output_factors).detach()


def layer_log_det(a: torch.Tensor, g: torch.Tensor, delta: float) -> torch.Tensor:
    kron = torch.kron(g, a)
    return torch.linalg.slogdet(kron + delta * torch.eye(kron.shape[0], dtype=kron.dtype))[1]


@pytest.mark.parametrize("name", ["gaussian", "multitask", "logistic", "softmax"])
def test_mlp_factors_and_log_det_match_explicit_kronecker_products(name):
    lik, c = likelihood(name)
    net = mlp(d_out=c)
    torch.manual_seed(1)
    x, y = torch.randn(9, 3, dtype=torch.float64), targets(name, 9)
    before = snapshot(net)
    curv = compute_curvature(net, x, y, lik, "kfac", batch_size=4)
    assert_unchanged(net, before)
    assert isinstance(curv, KroneckerGGN) and not curv.diagonal_names
    factors = mlp_factors(net, x, y, lik)
    assert len(curv.blocks) == len(factors)
    for block, (a, g) in zip(curv.blocks, factors):
        assert rel_err(block.input_factor, a) < 1e-12
        assert rel_err(output_factor(block, curv, lik), g) < 1e-12
    delta = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    expected = sum(layer_log_det(a, g, d) for (a, g), d in zip(factors, delta.tolist()))
    assert torch.allclose(curv.log_det(delta, lik), expected, rtol=1e-11)
    dense = curv.dense(lik) + torch.diag(delta[resolve_groups(net).column_groups()])
    assert torch.allclose(torch.linalg.slogdet(dense)[1], expected, rtol=1e-11)


@pytest.mark.parametrize("classes", [2, 3, 6])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_softmax_root_of_the_pass_has_c_minus_one_columns_and_squares_to_the_hessian(classes, temperature):
    """The KFAC pass's root of Λ/T₀ (C - 1 backward passes): R Rᵀ against the autograd Hessian of the
    torch.distributions log-likelihood, with one confident row (p ≈ 1 for the class whose column is dropped)."""
    lik = SoftmaxLikelihood(num_classes=classes, temperature=temperature).double()
    g = torch.Generator().manual_seed(4)
    f = 3 * torch.randn(7, classes, dtype=torch.float64, generator=g)
    f[0, -1], f[1, 0] = 12.0, 9.0
    y = torch.randint(0, classes, (7,), generator=g)
    root = DataPass.start(mlp(d_out=classes), lik).unit_hessian_root(f, y)
    assert root.shape == (7, classes, classes - 1)
    _, lam = reference_terms(lambda f, y: reference_log_prob("softmax", f, y, temperature=temperature), f, y)
    assert rel_err(root @ root.mT, lam * temperature) < 1e-13  # the unit root: Λ at T = 1


@pytest.mark.parametrize("name", ["gaussian", "multitask", "logistic", "softmax"])
def test_single_example_kronecker_blocks_are_the_exact_ggn_blocks(name):
    lik, c = likelihood(name)
    net = mlp(d_out=c)
    torch.manual_seed(2)
    x, y = torch.randn(1, 3, dtype=torch.float64), targets(name, 1)
    curv = compute_curvature(net, x, y, lik, "kfac")
    jac, _ = brute_jacobian(net, x)
    jn = jac.reshape(1, c, -1)
    ggn = torch.einsum("ncp,ncd,ndq->pq", jn, hessian(lik, net(x).detach(), y).detach(), jn)
    blocks = resolve_groups(net).column_groups()
    same_layer = blocks[:, None] == blocks[None, :]
    assert rel_err(curv.dense(lik), ggn * same_layer) < 1e-12


def cnn_factors(net, x, y, lik):
    """(A, G) of the conv layer (3×3 patches by explicit loops, 16 locations) and the head, by hand."""
    n = x.shape[0]
    f = net(x).detach()
    root = lambda_root(lik, f, y)
    a_conv = g_conv = a_head = g_head = 0.0
    for i in range(n):
        xi = x[i : i + 1]
        z = net.conv(xi)
        pooled = nn.functional.avg_pool2d(torch.relu(net.bn(z)), 2).flatten(1)
        out = net.head(pooled)
        for r in range(4):
            for s in range(4):
                patch = torch.cat([xi[0, :, r : r + 3, s : s + 3].reshape(-1), torch.ones(1, dtype=x.dtype)])
                a_conv = a_conv + torch.outer(patch, patch)
        head_in = torch.cat([pooled.detach()[0], torch.ones(1, dtype=x.dtype)])
        a_head = a_head + torch.outer(head_in, head_in)
        for m in range(f.shape[1]):
            gz, gout = torch.autograd.grad(block_loss(out[0], root[i], m), [z, out], retain_graph=True)
            g_head = g_head + torch.outer(gout[0], gout[0])
            for r in range(4):
                for s in range(4):
                    g_conv = g_conv + torch.outer(gz[0, :, r, s], gz[0, :, r, s])
    return (a_conv, g_conv / (16 * n)), (a_head, g_head / n)


def test_conv2d_kfac_with_batchnorm_as_a_diagonal_block():
    """Conv2d and Linear in Kronecker form (KFAC-expand); BatchNorm's affine parameters as the exact
    diagonal GGN block."""
    net = small_cnn(c_out=2)
    lik = SoftmaxLikelihood(num_classes=2, temperature=0.8).double()
    torch.manual_seed(4)
    x, y = torch.randn(6, 1, 6, 6, dtype=torch.float64), torch.randint(0, 2, (6,))
    before = snapshot(net)
    curv = compute_curvature(net, x, y, lik, "kfac", batch_size=4)
    assert_unchanged(net, before)
    (a_conv, g_conv), (a_head, g_head) = cnn_factors(net, x, y, lik)
    conv, head = curv.blocks
    assert (conv.module, head.module) == ("conv", "head")
    assert rel_err(conv.input_factor, a_conv) < 1e-12 and rel_err(output_factor(conv, curv, lik), g_conv) < 1e-12
    assert rel_err(head.input_factor, a_head) < 1e-12 and rel_err(output_factor(head, curv, lik), g_head) < 1e-12
    assert curv.diagonal_names == ["bn.weight", "bn.bias"]
    jac, _ = brute_jacobian(net, x)
    jn = jac.reshape(6, 2, -1)
    ggn_diag = torch.einsum("ncp,ncd,ndp->p", jn, hessian(lik, net(x).detach(), y).detach(), jn)
    bn = torch.cat([torch.full((p.numel(),), n.startswith("bn.")) for n, p in net.named_parameters()])
    assert rel_err(curv.dense(lik).diagonal()[bn], ggn_diag[bn]) < 1e-12
    delta = torch.tensor([0.7, 1.5, 2.5], dtype=torch.float64)  # conv, bn, head
    expected = (
        layer_log_det(a_conv, g_conv, 0.7)
        + torch.log(ggn_diag[bn] + 1.5).sum()
        + layer_log_det(a_head, g_head, 2.5)
    )
    assert torch.allclose(curv.log_det(delta, lik), expected, rtol=1e-11)


@pytest.mark.parametrize("name", ["multitask", "softmax"])
def test_new_hyperparameters_and_gradients(name):
    """A new noise (per output: Σ_c s_c G_c re-decomposed) or temperature (eigenvalues rescaled) equals the
    hand-built factors at the new value; gradients w.r.t. δ, noise and temperature match finite differences."""
    lik, c = likelihood(name)
    net = mlp(d_out=c)
    torch.manual_seed(6)
    x, y = torch.randn(8, 3, dtype=torch.float64), targets(name, 8)
    curv = compute_curvature(net, x, y, lik, "kfac")
    if name == "multitask":
        lik.task_noises = torch.tensor([0.9, 0.05], dtype=torch.float64)
        raw = lik.raw_task_noises
    else:
        lik.temperature = 0.45
        raw = lik.raw_temperature.requires_grad_(True)
    factors = mlp_factors(net, x, y, lik)
    expected = sum(layer_log_det(a, g, 1.3) for a, g in factors)
    assert torch.allclose(curv.log_det(1.3, lik), expected, rtol=1e-11)
    delta = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(curv.log_marginal_likelihood(delta, lik), [delta, raw])
    eps = 1e-6
    for value, grad in zip([delta, raw], grads):
        for i in range(value.numel()):
            with torch.no_grad():
                value.view(-1)[i] += eps
                up = curv.log_marginal_likelihood(delta, lik)
                value.view(-1)[i] -= 2 * eps
                down = curv.log_marginal_likelihood(delta, lik)
                value.view(-1)[i] += eps
            assert torch.allclose(grad.view(-1)[i], (up - down) / (2 * eps), rtol=1e-6, atol=1e-8)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))[:, :1]


def test_kfac_errors():
    lik, _ = likelihood("gaussian")
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="one prior precision"):
        compute_curvature(mlp(), x, y, lik, "kfac", prior_structure="parameter")
    with pytest.raises(ValueError, match="more than once"):
        compute_curvature(Shared(), x, y, lik, "kfac")
    tied = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Linear(3, 1)).double()
    tied[2].weight = tied[0].weight
    with pytest.raises(ValueError, match="shared"):
        compute_curvature(tied, x, y, lik, "kfac")
    grouped = nn.Sequential(nn.Conv2d(2, 2, 1, groups=2), nn.Flatten(), nn.Linear(2, 1)).double()
    with pytest.raises(NotImplementedError, match="groups=1"):
        compute_curvature(grouped, torch.randn(4, 2, 1, 1, dtype=torch.float64), y, lik, "kfac")


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn", "diag_ef"])
def test_empty_loaders_and_batches_without_targets_raise_a_clear_error(structure):
    from torch.utils.data import DataLoader, TensorDataset

    from ntkgp.laplace.weight_space import compute_curvature
    from ntkgp.likelihoods import SoftmaxLikelihood

    net = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    empty = DataLoader(TensorDataset(torch.randn(0, 2), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match="the data is empty"):
        compute_curvature(net, empty, None, SoftmaxLikelihood(3), structure=structure)
    inputs_only = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    with pytest.raises(ValueError, match=r"iterable of \(x, y\) batches"):
        compute_curvature(net, inputs_only, None, SoftmaxLikelihood(3), structure=structure)


def test_the_pass_makes_one_forward_pass_per_batch_and_c_minus_one_backward_for_a_softmax(monkeypatch):
    """Counted by a forward hook and around torch.autograd.grad: each extra batch costs one forward pass (the
    cotangents come from the feature pass's own outputs) and C - 1 backward passes (the softmax's rank)."""
    lik = SoftmaxLikelihood(num_classes=3).double()
    net = mlp(d_out=3)
    torch.manual_seed(3)
    x, y = torch.randn(9, 3, dtype=torch.float64), targets("softmax", 9)
    calls = {"forward": 0, "backward": 0}
    handle = net.register_forward_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.__setitem__("backward", calls["backward"] + 1)
                        or grad(*a, **k))
    compute_curvature(net, x, y, lik, "kfac", batch_size=9)  # the layer plan: checked once per architecture
    counts = []
    for batch_size in (9, 3):  # one batch, then three
        calls.update(forward=0, backward=0)
        compute_curvature(net, x, y, lik, "kfac", batch_size=batch_size)
        counts.append(dict(calls))
    handle.remove()
    assert counts[1]["forward"] - counts[0]["forward"] == 2
    assert counts[1]["backward"] - counts[0]["backward"] == 2 * 2
