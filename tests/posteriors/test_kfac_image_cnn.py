"""The KFAC fit and GLM predictive on a CNN of the image benchmark's shape (two convolutions with 'same'
padding, ReLU and max-pooling, two linear layers) against brute force: patches by ``F.unfold``, output gradients
per location by ``torch.func.jacrev`` through a zero perturbation of each layer's output, the softmax Hessian, and the GLM covariance from autograd Jacobians and the explicit inverse of the block-diagonal
precision (float64); and a float32 network against its float64 copy."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.func import jacrev

from ntkgp.laplace import PassOptions, predict
from ntkgp.laplace.weight_space import KFACLaplace, compute_curvature
from ntkgp.laplace.weight_space.kfac import factor_sums
from ntkgp.laplace.weight_space.kfac.factor_sums import location_gram, symmetric_gram
from ntkgp.likelihoods import SoftmaxLikelihood, hessian
from tests.helpers import EPS32, assert_unchanged, brute_jacobian, float32_roundings, rel_err, snapshot

C = 3


def image_cnn(dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(3 * 2 * 2, 5), nn.ReLU(), nn.Linear(5, C),
    ).to(dtype).eval()


def data(n: int = 7, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 1, 8, 8, generator=g).to(dtype), torch.randint(0, C, (n,), generator=g)


def brute_factors(net: nn.Sequential, x: torch.Tensor, y: torch.Tensor, lik,
                  lam: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, G) per layer: A = Σ_n Σ_t ā ā^T from F.unfold patches, G = (1/(N T)) Σ_n Σ_t J_t^T Λ_n J_t with J_t the
    jacrev of f w.r.t. a zero perturbation of the layer's output at location t (``lam``: Λ_n given instead)."""
    layers = [i for i, m in enumerate(net) if isinstance(m, nn.Conv2d | nn.Linear)]
    if lam is None:
        lam = hessian(lik, net(x).detach(), y).detach()  # Λ_n, (N, C, C)
    out = []
    for i in layers:
        layer = net[i]
        inputs = net[:i](x).detach()
        if isinstance(layer, nn.Conv2d):
            patches = nn.functional.unfold(inputs, 3, padding=1)  # (n, d_in, T)
        else:
            patches = inputs[..., None]
        a_bar = torch.cat([patches, torch.ones_like(patches[:, :1])], dim=1)
        a = torch.einsum("nit,njt->ij", a_bar, a_bar)
        z = net[: i + 1](x).detach()

        def head(delta, xn, i=i):
            return net[i + 1 :](net[: i + 1](xn) + delta)

        g = 0
        for n in range(x.shape[0]):
            jac = jacrev(head)(torch.zeros_like(z[n : n + 1]), x[n : n + 1])[0]  # (C, 1, d_out, *spatial)
            gamma = jac.reshape(C, layer.weight.shape[0], -1)  # (C, d_out, T)
            g = g + torch.einsum("cot,cd,dpt->op", gamma, lam[n], gamma)  # Σ_m (L^T Γ)_m (L^T Γ)_m^T
        out.append((a, g / (x.shape[0] * patches.shape[-1])))
    return out


@pytest.mark.parametrize("rows", [1024, 3])
def test_factors_of_an_image_cnn_equal_brute_force(monkeypatch, rows):
    """``rows = 3``: the linear layers' inputs gathered over batches are multiplied several times in the pass."""
    monkeypatch.setattr(factor_sums, "ROWS", rows)
    net, (x, y), lik = image_cnn(), data(), SoftmaxLikelihood(C).double()
    before = snapshot(net)
    curvature = compute_curvature(net, x, y, lik, "kfac", batch_size=2)
    assert_unchanged(net, before)
    for block, (a, g) in zip(curvature.blocks, brute_factors(net, x, y, lik)):
        assert rel_err(block.input_factor, a) < 1e-12
        # G = Σ J^T Λ J cancels (Λ annihilates the direction of ones): the first layer's, ~6e-5, agrees to ~5e-10
        # with either computation (the code before the factors' running sums gave the same difference)
        assert rel_err(block.output_factors.sum(0), g) < 1e-8


def test_glm_covariance_of_an_image_cnn_equals_the_dense_sandwich():
    net, (x, y), lik = image_cnn(), data(), SoftmaxLikelihood(C).double()
    x_test = data(4)[0] + 0.5
    posterior = KFACLaplace(net, x, y, lik, prior_precision=0.7, prior_structure="network", options=PassOptions(batch_size=3))
    factors = brute_factors(net, x, y, lik)
    index = torch.cat([b.index.reshape(-1) for b in posterior.blocks])
    blocks = [torch.kron(g, a) + 0.7 * torch.eye(a.shape[0] * g.shape[0], dtype=a.dtype) for a, g in factors]
    precision = torch.zeros(len(index), len(index), dtype=torch.float64)
    precision[index[:, None], index[None, :]] = torch.block_diag(*blocks)
    jac, _ = brute_jacobian(net, x_test)
    expected = (jac @ torch.linalg.solve(precision, jac.T)).reshape(4, C, 4, C).diagonal(dim1=0, dim2=2)
    assert rel_err(posterior.glm_covariance(x_test), expected.permute(2, 0, 1)) < 1e-10


def test_float32_image_cnn_matches_its_float64_copy():
    net64, (x, y), lik = image_cnn(), data(40), SoftmaxLikelihood(C)
    net32 = copy.deepcopy(net64).float()
    x_test = data(6)[0] + 0.3
    posts = [KFACLaplace(n, x.to(d), y, lik.to(d), prior_precision=0.5, prior_structure="network", options=PassOptions(batch_size=16))
             for n, d in ((net32, torch.float32), (net64, torch.float64))]
    # Error model (ε = ε32, r = float32_roundings: the relative rounding of the activations, outputs and output
    # gradients of this network, f and its Jacobians measured on the float64 copy). A = Σ ā āᵀ over m = N·T
    # products: ‖ΔA‖_F ≤ (2r + log2 m) ε tr A. G = Σ J_tᵀ Λ_n J_t / (NT) cancels (Λ annihilates the ones), so its
    # error is bounded by the same sum without cancellation, G_abs = Σ ‖Λ_n‖ J_tᵀ J_t / (NT):
    # ‖ΔG‖_F ≤ (2r(1 + 4 max|f|) + log2 m + 2C) ε tr G_abs (Λ moves with f, the product ΛJ adds C roundings).
    # The covariance J* (G⊗A + δ)⁻¹ J*ᵀ per block b: ‖ΔC‖_F ≤ Σ_b ‖J*_b‖_F² (2rε + η_b κ_b)/δ, with η_b the
    # relative errors of A_b and G_b plus the eigendecomposition's d_b ε, κ_b = (‖G_b‖‖A_b‖ + δ)/δ.
    delta, r = 0.5, float32_roundings(net64)
    with torch.no_grad():
        f = net64(x)
    m = x.shape[0] * 64  # the most products summed into one factor entry: N examples × 8·8 locations
    lam_abs = torch.linalg.matrix_norm(hessian(lik.double(), f, y), ord=2)[:, None, None] * torch.eye(C, dtype=f.dtype)
    bounds_g = [g.trace().item() for _, g in brute_factors(net64, x, y, lik.double(), lam=lam_abs)]
    jac, _ = brute_jacobian(net64, x_test)
    cov_error = 0.0
    for b32, b64, g_abs in zip(posts[0].blocks, posts[1].blocks, bounds_g):
        a64, g64 = b64.input_factor, b64.output_factors.sum(0)
        error_a = (2 * r + math.log2(m)) * EPS32 * a64.trace().item()
        error_g = (2 * r * (1 + 4 * f.abs().max().item()) + math.log2(m) + 2 * C) * EPS32 * g_abs
        assert b32.input_factor.dtype == torch.float32
        assert (b32.input_factor.double() - a64).norm() <= error_a
        assert (b32.output_factors.double().sum(0) - g64).norm() <= error_g
        norm_a, norm_g = (torch.linalg.matrix_norm(t, ord=2).item() for t in (a64, g64))
        eta = error_a / norm_a + error_g / norm_g + a64.shape[0] * g64.shape[0] * EPS32
        kappa = (norm_a * norm_g + delta) / delta
        cov_error += jac[:, b64.index.reshape(-1)].square().sum().item() * (2 * r * EPS32 + eta * kappa) / delta
    cov32, cov64 = (p.glm_covariance(x_test.to(d)) for p, d in zip(posts, (torch.float32, torch.float64)))
    assert cov_error < 1e-2 * cov64.norm()  # a meaningful bound: a 1 % error fails
    assert cov32.dtype == torch.float32 and (cov32.double() - cov64).norm() <= cov_error
    # probit: p = softmax(z), z_c = f_c / √(1 + π σ_c²/8): |Δp| ≤ ½ max|Δz| (Σ_k |∂p_c/∂z_k| = 2p_c(1 − p_c)),
    # |Δz| ≤ |Δf| + (π/16)|f||Δσ²|, with |Δf| ≤ rε(|f| + ‖J*‖‖θ‖) as in float32_roundings
    with torch.no_grad():
        f_test = net64(x_test)
    theta = torch.cat([p.reshape(-1) for p in net64.parameters()]).norm()
    d_f = r * EPS32 * (f_test.abs().max() + jac.norm(dim=1).max() * theta).item()
    prob_error = 0.5 * (d_f + math.pi / 16 * f_test.abs().max().item() * cov_error)
    assert prob_error < 1e-2
    probs32, probs64 = (predict(p, x_test.to(d), link="probit").probs for p, d in zip(posts, (torch.float32, torch.float64)))
    assert (probs32.double() - probs64).abs().max() <= prob_error


def test_symmetric_and_location_grams_equal_plain_products():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 1100, dtype=torch.float64, generator=g)  # 2 blocks a side
    assert rel_err(symmetric_gram(x), x.T @ x) < 1e-14
    for d in (6, 300, 530):  # one block; 2 and 4 blocks a side (the upper ones multiplied, the others mirrored)
        a = torch.randn(70, d, 9, dtype=torch.float64, generator=g)  # two chunks of 64 examples
        assert rel_err(location_gram(a), torch.einsum("nit,njt->ij", a, a)) < 1e-14
