"""ntkgp.laplace.predict: every estimator against the closed form of a dense brute force.

Closed forms (``glm`` for every structure, joint and per point; probit; bridge) to 1e-10 in float64.
Sampling methods at the Monte Carlo rate with fixed seeds: every entry within 5 standard errors
(|mean − f| < 5 σ/√S, |Ĉ_cc' − Σ_cc'| < 5 √((Σ_cc'² + Σ_cc Σ_c'c')/S)), S = 8000 draws of the weights
(20000 draws of f for the MC link).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal

from ntkgp.laplace.weight_space import FullLaplace, KFACLaplace, LastLayerLaplace, laplace_posterior
from ntkgp.laplace.weight_space.posterior.predictive_estimators import Prediction, default_step_size, laplace_bridge, predict
from tests.helpers import EPS32, assert_unchanged, mlp, small_cnn, snapshot
from tests.posteriors.reference import DTYPE, glm_blocks, likelihood_case, targets

TOL = 1e-10
S = 8000


def close(a, b, tol=TOL):
    assert (a - b).abs().max().item() <= tol * (1 + b.abs().max().item())


def case(name: str, width: int = 4, seed: int = 1):
    lik, c, _ = likelihood_case(name)
    net = mlp(3, width, c, depth=2, seed=seed)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 3, dtype=DTYPE, generator=g)
    return net, lik, x, targets(name, 12), torch.randn(5, 3, dtype=DTYPE, generator=g)


def within_mc_rate(blocks_hat, blocks, samples_mean=None, mean=None, num=S):
    var = blocks.diagonal(dim1=-2, dim2=-1)
    se = ((blocks.square() + var[..., :, None] * var[..., None, :]) / num).sqrt()
    assert ((blocks_hat - blocks).abs() < 5 * se).all()
    if samples_mean is not None:
        assert ((samples_mean - mean).abs() < 5 * (var / num).sqrt()).all()


@pytest.mark.parametrize("structure", ["full_ggn", "kfac", "diag_ggn", "full_ef"])
@pytest.mark.parametrize("name", ["gaussian", "multitask", "softmax"])
def test_glm_closed_form_equals_brute_force(name, structure):
    net, lik, x, y, x_test = case(name)
    delta = torch.tensor([0.3, 1.0, 4.0], dtype=DTYPE)
    posterior = laplace_posterior(net, x, y, lik, structure=structure, prior_precision=delta)
    sigma = posterior.dense_covariance()
    blocks, joint = glm_blocks(net, x_test, sigma)
    pred = predict(posterior, x_test, method="glm", link=None if name != "softmax" else "probit")
    with torch.no_grad():
        f = net(x_test)
    c = f.shape[1]
    assert isinstance(pred.f, MultivariateNormal if c == 1 else MultitaskMultivariateNormal)
    close(pred.f.mean.reshape(-1, c), f)
    close(pred.f.variance.reshape(-1, c), blocks.diagonal(dim1=-2, dim2=-1))
    dense = pred.f.covariance_matrix
    close(dense, torch.block_diag(*blocks))
    pred_joint = predict(
        posterior, x_test, method="glm", joint=True, link=None if name != "softmax" else "probit"
    )
    close(pred_joint.f.covariance_matrix, joint)
    if name == "softmax":
        scaled = f / torch.sqrt(1 + math.pi / 8 * blocks.diagonal(dim1=-2, dim2=-1))
        close(pred.probs, torch.softmax(scaled, -1))
        close(pred_joint.probs, pred.probs)


def test_binary_probit_and_mc_links():
    net, lik, x, y, x_test = case("logistic")
    posterior = FullLaplace(net, x, y, lik, prior_precision=0.5)
    blocks, _ = glm_blocks(net, x_test, posterior.dense_covariance())
    with torch.no_grad():
        mu = net(x_test)[:, 0]
    var = blocks[:, 0, 0]
    pred = predict(posterior, x_test)
    assert pred.link == "probit" and pred.probs.shape == (5,)
    close(pred.probs, torch.sigmoid(mu / torch.sqrt(1 + math.pi / 8 * var)))
    # E[sigmoid(f)] by 100-point Gauss–Hermite quadrature as the reference of the MC link
    nodes, weights = (torch.from_numpy(a) for a in np.polynomial.hermite_e.hermegauss(100))
    exact = (torch.sigmoid(mu[:, None] + var.sqrt()[:, None] * nodes) * weights).sum(-1) / math.sqrt(
        2 * math.pi
    )
    mc = predict(
        posterior, x_test, link="mc", num_samples=S, generator=torch.Generator().manual_seed(0)
    ).probs
    assert ((mc - exact).abs() < 5 * 0.5 / math.sqrt(S)).all()
    with pytest.raises(ValueError, match="bridge"):
        predict(posterior, x_test, link="bridge")


def test_laplace_bridge_inverts_the_dirichlet_laplace_approximation():
    """Dir(α) in the softmax basis has the Laplace approximation μ_k = log α_k − mean(log α),
    σ²_k = (1 − 2/C)/α_k + Σ_l (1/α_l)/C²; the bridge maps it back to the Dirichlet mean α/Σα."""
    alpha = torch.tensor([[0.7, 2.0, 5.0, 1.2], [30.0, 0.3, 3.0, 9.0]], dtype=DTYPE)
    c = alpha.shape[1]
    mu = alpha.log() - alpha.log().mean(-1, keepdim=True)
    var = (1 - 2 / c) / alpha + (1 / alpha).sum(-1, keepdim=True) / c**2
    close(laplace_bridge(mu, var), alpha / alpha.sum(-1, keepdim=True))
    close(
        laplace_bridge(mu + 300.0, var), alpha / alpha.sum(-1, keepdim=True)
    )  # shift-invariant, no overflow


@pytest.mark.parametrize("structure", ["full_ggn", "kfac"])
def test_glm_mc_converges_to_the_closed_form(structure):
    net, lik, x, y, x_test = case("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure=structure, prior_precision=0.7)
    exact = predict(posterior, x_test)
    blocks = exact.f.lazy_covariance_matrix.to_dense()
    blocks = torch.stack([blocks[3 * i : 3 * i + 3, 3 * i : 3 * i + 3] for i in range(5)])
    pred = predict(
        posterior, x_test, method="glm_mc", num_samples=S, generator=torch.Generator().manual_seed(3)
    )
    assert pred.samples.shape == (S, 5, 3)
    close(pred.f.mean, exact.f.mean)  # the linearized model's mean is known
    hat = torch.stack([pred.f.covariance_matrix[3 * i : 3 * i + 3, 3 * i : 3 * i + 3] for i in range(5)])
    within_mc_rate(hat, blocks, pred.samples.mean(0), exact.f.mean)
    close(pred.probs, torch.softmax(pred.f.mean / (1 + math.pi / 8 * pred.f.variance).sqrt(), -1))
    mc = predict(
        posterior,
        x_test,
        method="glm_mc",
        link="mc",
        num_samples=50,
        generator=torch.Generator().manual_seed(3),
    )
    close(mc.probs, torch.softmax(mc.samples, -1).mean(0))


def test_mc_glm_finite_differences_match_the_exact_directional_derivatives():
    """Same draws: central differences agree with forward-mode JVPs to O(h²), forward differences to O(h)."""
    net, lik, x, y, x_test = case("multitask")
    posterior = KFACLaplace(net, x, y, lik, prior_precision=0.7)
    exact = predict(
        posterior, x_test, method="glm_mc", num_samples=200, generator=torch.Generator().manual_seed(4)
    )
    for scheme, tol in (("central", 1e-7), ("forward", 1e-5)):
        fd = predict(
            posterior,
            x_test,
            method="mc_glm",
            num_samples=200,
            finite_difference=scheme,
            generator=torch.Generator().manual_seed(4),
        )
        rel = (fd.samples - exact.samples).abs().max() / (exact.samples - exact.f.mean).abs().max()
        assert rel < tol, (scheme, rel)
    assert default_step_size(torch.float64) == pytest.approx(torch.finfo(torch.float64).eps ** (1 / 3))
    assert default_step_size(torch.float32, "forward") == pytest.approx(torch.finfo(torch.float32).eps ** 0.5)


def test_nn_sampling_equals_glm_when_the_network_is_linear_in_the_weights():
    """A last-layer posterior: f is affine in θ, so the sampled network is the GLM; sample mean and covariance
    (1/(S−1)) converge to f(x; θ*) and J Σ Jᵀ at the Monte Carlo rate."""
    net, lik, x, y, x_test = case("multitask")
    posterior = LastLayerLaplace(net, x, y, lik, prior_precision=0.4)
    exact = predict(posterior, x_test)
    blocks = torch.stack([exact.f.covariance_matrix[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] for i in range(5)])
    pred = predict(
        posterior, x_test, method="nn_sampling", num_samples=S, generator=torch.Generator().manual_seed(5)
    )
    hat = torch.stack([pred.f.covariance_matrix[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] for i in range(5)])
    within_mc_rate(hat, blocks, pred.f.mean, exact.f.mean)
    close(pred.f.mean, pred.samples.mean(0))
    joint = predict(
        posterior,
        x_test,
        method="nn_sampling",
        num_samples=50,
        joint=True,
        generator=torch.Generator().manual_seed(5),
    )
    centred = (joint.samples - joint.samples.mean(0)).reshape(50, -1)
    close(joint.f.covariance_matrix, centred.T @ centred / 49)


def test_predict_on_a_cnn_float32_and_network_untouched():
    net = small_cnn(c_out=3, seed=3, dtype=torch.float32)
    lik = likelihood_case("softmax")[0].float()
    x = torch.randn(10, 1, 6, 6)
    y = targets("softmax", 10)
    before = snapshot(net)
    posterior = KFACLaplace(net, x, y, lik, input_shape=(1, 6, 6))
    for method in ("glm", "glm_mc", "mc_glm", "nn_sampling"):
        for link in ("probit", "bridge", "mc"):
            pred = predict(
                posterior,
                x[:4].flatten(1),
                method=method,
                link=link,
                num_samples=8,
                generator=torch.Generator().manual_seed(0),
            )
            assert isinstance(pred, Prediction) and pred.probs.dtype == torch.float32
            # normalized in float32: each probability vector sums to 1 within (⌈log2 C⌉ + 2)ε32 (its denominator's
            # sum and the division; the exponentials' roundings cancel in the ratio), an average over S samples adds
            # ⌈log2 S⌉ + 1 and the sum here ⌈log2 C⌉: C = 3, S = 8 give 11ε32 ≈ 1.3e-6
            classes, samples = pred.probs.shape[-1], 8
            bound = (2 * math.ceil(math.log2(classes)) + math.ceil(math.log2(samples)) + 3) * EPS32
            assert ((pred.probs.sum(-1).double() - 1).abs() <= bound).all()
            assert (pred.f.variance >= 0).all()
    assert_unchanged(net, before)


def test_glm_equals_the_function_space_ntkgp():
    """The weight-space full-GGN GLM predictive and NTKGP's function-space one are the same variance."""
    import ntkgp

    net, lik, x, y, x_test = case("gaussian")
    delta = torch.tensor([0.3, 1.0, 4.0], dtype=DTYPE)
    posterior = FullLaplace(net, x, y, lik, prior_precision=delta)
    model = ntkgp.NTKGP(net, x, y.reshape(-1), lik, prior_precision=delta)
    model.eval()
    with torch.no_grad():
        function_space = model(x_test).variance
    close(predict(posterior, x_test).f.variance, function_space, 1e-9)


def test_validation_names_the_argument():
    net, lik, x, y, x_test = case("gaussian")
    posterior = FullLaplace(net, x, y, lik)
    with pytest.raises(ValueError, match="method"):
        predict(posterior, x_test, method="laplace")
    with pytest.raises(ValueError, match="link"):
        predict(posterior, x_test, link="probit")
    with pytest.raises(ValueError, match="num_samples"):
        predict(posterior, x_test, method="glm_mc", num_samples=0)
    with pytest.raises(ValueError, match="num_samples"):
        predict(posterior, x_test, method="nn_sampling", num_samples=1)
    with pytest.raises(ValueError, match="step_size"):
        predict(posterior, x_test, method="mc_glm", step_size=-1.0)
    with pytest.raises(ValueError, match="finite_difference"):
        predict(posterior, x_test, method="mc_glm", finite_difference="backward")
    with pytest.raises(TypeError, match="posterior"):
        predict(net, x_test)
    with pytest.raises(TypeError, match="generator"):
        predict(posterior, x_test, generator=0)
    with pytest.raises(ValueError, match="x"):
        predict(posterior, torch.full((2, 3), float("nan"), dtype=DTYPE))
    _, soft, xs, ys, _ = case("softmax")
    with pytest.raises(ValueError, match="link"):
        predict(FullLaplace(mlp(3, 4, 3, depth=2), xs, ys, soft), x_test, link="exact")


@pytest.mark.cuda
@pytest.mark.parametrize("structure", ["full_ggn", "kfac", "diag_ggn"])
def test_posteriors_and_every_method_on_cuda(structure):
    net, lik, x, y, x_test = case("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure=structure, prior_precision=0.7)
    cpu = predict(posterior, x_test).f.variance
    device = torch.device("cuda")
    net_gpu = mlp(3, 4, 3, depth=2, seed=1).to(device)
    gpu_posterior = laplace_posterior(
        net_gpu, x.to(device), y.to(device), lik.to(device), structure=structure, prior_precision=0.7
    )
    close(predict(gpu_posterior, x_test.to(device)).f.variance.cpu(), cpu, 1e-8)
    for method in ("glm_mc", "mc_glm", "nn_sampling"):
        pred = predict(gpu_posterior, x_test.to(device), method=method, num_samples=16, link="mc")
        assert pred.probs.device.type == "cuda" and torch.isfinite(pred.probs).all()
