"""log p, g, Λ and the factor L of every supported likelihood against torch.distributions and autograd."""

from __future__ import annotations

import math
from collections.abc import Callable

import gpytorch
import pytest
import torch
from torch import Tensor
from torch.distributions import Bernoulli, Categorical, Normal

from ntkgp.likelihoods import (
    LogisticLikelihood,
    SoftmaxLikelihood,
    gradient,
    hessian,
    hessian_sqrt,
    log_likelihood,
    noise_variance,
)

N = 7
EPS32 = torch.finfo(torch.float32).eps


def _gaussian() -> gpytorch.likelihoods.Likelihood:
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    likelihood.noise = 0.3
    return likelihood


def _multitask(has_task_noise: bool, has_global_noise: bool) -> Callable[[], gpytorch.likelihoods.Likelihood]:
    def build() -> gpytorch.likelihoods.Likelihood:
        likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(
            num_tasks=3, rank=0, has_task_noise=has_task_noise, has_global_noise=has_global_noise
        )
        if has_task_noise:
            likelihood.task_noises = torch.tensor([0.1, 0.5, 2.0])
        if has_global_noise:
            likelihood.noise = 0.25
        return likelihood

    return build


def _logistic(temperature: float) -> Callable[[], gpytorch.likelihoods.Likelihood]:
    return lambda: LogisticLikelihood(temperature=temperature, learn_temperature=True)


def _softmax(temperature: float) -> Callable[[], gpytorch.likelihoods.Likelihood]:
    return lambda: SoftmaxLikelihood(4, temperature=temperature, learn_temperature=True)


def _gpytorch_softmax() -> gpytorch.likelihoods.Likelihood:
    return gpytorch.likelihoods.SoftmaxLikelihood(num_classes=4, mixing_weights=False)


def _reference_log_likelihood(likelihood: gpytorch.likelihoods.Likelihood, f: Tensor, y: Tensor) -> Tensor:
    """log p(y_n | f_n) from torch.distributions, shape (N,)."""
    if isinstance(likelihood, LogisticLikelihood):
        return Bernoulli(logits=f.squeeze(-1)).log_prob(y.reshape(-1).to(f)) / likelihood.temperature
    if isinstance(likelihood, gpytorch.likelihoods.SoftmaxLikelihood):
        log_p = Categorical(logits=f).log_prob(y)
        return log_p / likelihood.temperature if isinstance(likelihood, SoftmaxLikelihood) else log_p
    scale = noise_variance(likelihood).sqrt()
    return Normal(f, scale).log_prob(y.reshape(f.shape)).sum(-1)


# (likelihood builder, C, target kind)
CASES = {
    "gaussian": (_gaussian, 1, "real_flat"),
    "gaussian_2d_targets": (_gaussian, 1, "real"),
    "multitask_task_noise": (_multitask(True, False), 3, "real"),
    "multitask_global_noise": (_multitask(False, True), 3, "real"),
    "multitask_both_noises": (_multitask(True, True), 3, "real"),
    "logistic": (_logistic(1.0), 1, "binary"),
    "logistic_tempered": (_logistic(2.5), 1, "binary"),
    "softmax": (_softmax(1.0), 4, "labels"),
    "softmax_tempered": (_softmax(0.7), 4, "labels"),
    "gpytorch_softmax": (_gpytorch_softmax, 4, "labels"),
}


def _data(num_outputs: int, kind: str, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    f = 2.0 * torch.randn(N, num_outputs, generator=generator, dtype=dtype)
    if kind == "real_flat":
        y = torch.randn(N, generator=generator, dtype=dtype)
    elif kind == "real":
        y = torch.randn(N, num_outputs, generator=generator, dtype=dtype)
    elif kind == "binary":
        y = torch.randint(0, 2, (N,), generator=generator).to(dtype)
    else:
        y = torch.randint(0, num_outputs, (N,), generator=generator)
    return f, y


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[gpytorch.likelihoods.Likelihood, Tensor, Tensor]:
    build, num_outputs, kind = CASES[request.param]
    f, y = _data(num_outputs, kind)
    return build().double(), f, y


def test_log_likelihood_matches_torch_distributions(case):
    likelihood, f, y = case
    value = log_likelihood(likelihood, f, y)
    assert value.shape == (N,)
    torch.testing.assert_close(value, _reference_log_likelihood(likelihood, f, y))


def test_gradient_and_hessian_match_autograd_per_example(case):
    likelihood, f, y = case
    g, lam = gradient(likelihood, f, y), hessian(likelihood, f, y)
    num_outputs = f.shape[-1]
    assert g.shape == (N, num_outputs) and lam.shape == (N, num_outputs, num_outputs)
    for n in range(N):

        def log_p(f_n: Tensor, n: int = n) -> Tensor:
            return log_likelihood(likelihood, f_n.unsqueeze(0), y[n : n + 1]).sum()

        torch.testing.assert_close(g[n], torch.autograd.functional.jacobian(log_p, f[n]))
        torch.testing.assert_close(lam[n], -torch.autograd.functional.hessian(log_p, f[n]))


def test_hessian_is_symmetric_psd(case):
    likelihood, f, y = case
    lam = hessian(likelihood, f, y)
    torch.testing.assert_close(lam, lam.mT)
    assert torch.linalg.eigvalsh(lam).min() > -1e-12


def test_hessian_sqrt_is_a_factor_of_the_hessian(case):
    likelihood, f, y = case
    root = hessian_sqrt(likelihood, f, y)
    torch.testing.assert_close(root @ root.mT, hessian(likelihood, f, y))


def test_hessian_sqrt_gives_the_determinant_and_solve_of_the_symmetric_square_root(case):
    """log|I + Lᵀ K L| and L (I + Lᵀ K L)⁻¹ Lᵀ equal their forms with the symmetric Λ^{1/2} (eigh)."""
    likelihood, f, y = case
    root, lam = hessian_sqrt(likelihood, f, y), hessian(likelihood, f, y)
    eigenvalues, eigenvectors = torch.linalg.eigh(lam)
    symmetric = eigenvectors @ torch.diag_embed(eigenvalues.clamp_min(0).sqrt()) @ eigenvectors.mT
    root_full, symmetric_full = torch.block_diag(*root), torch.block_diag(*symmetric)
    size = root_full.shape[0]
    a = torch.randn(size, 3 * size, dtype=f.dtype, generator=torch.Generator().manual_seed(1))
    kernel = a @ a.mT / a.shape[1]
    eye = torch.eye(kernel.shape[0], dtype=f.dtype)
    inner_root = eye + root_full.mT @ kernel @ root_full
    inner_symmetric = eye + symmetric_full @ kernel @ symmetric_full
    torch.testing.assert_close(torch.logdet(inner_root), torch.logdet(inner_symmetric))
    torch.testing.assert_close(
        root_full @ torch.linalg.solve(inner_root, root_full.mT),
        symmetric_full @ torch.linalg.solve(inner_symmetric, symmetric_full),
    )


def test_softmax_hessian_sqrt_closed_form():
    f, y = _data(4, "labels")
    p = torch.softmax(f, -1)
    expected = torch.diag_embed(p.sqrt()) - p.unsqueeze(-1) * p.sqrt().unsqueeze(-2)
    torch.testing.assert_close(hessian_sqrt(SoftmaxLikelihood(4).double(), f, y), expected)


def test_diagonal_likelihoods_have_symmetric_root():
    for name in ("gaussian", "multitask_both_noises", "logistic_tempered"):
        build, num_outputs, kind = CASES[name]
        f, y = _data(num_outputs, kind)
        root = hessian_sqrt(build().double(), f, y)
        torch.testing.assert_close(root, root.mT)


@pytest.mark.parametrize("name", ["logistic_tempered", "softmax_tempered"])
def test_temperature_scales_every_term(name):
    build, num_outputs, kind = CASES[name]
    f, y = _data(num_outputs, kind)
    tempered = build().double()
    cold = build().double()
    cold.temperature = 1.0
    temperature = tempered.temperature.item()
    for term in (log_likelihood, gradient, hessian):
        torch.testing.assert_close(term(tempered, f, y), term(cold, f, y) / temperature)
    expected_root = hessian_sqrt(cold, f, y) / math.sqrt(temperature)
    torch.testing.assert_close(hessian_sqrt(tempered, f, y), expected_root)


def test_gradients_reach_the_hyperparameters(case):
    """Autograd through every term reaches noise / temperature, and matches the reference log-likelihood."""
    likelihood, f, y = case
    hyperparameters = [p for p in likelihood.parameters() if p.requires_grad]
    if not hyperparameters:
        pytest.skip("likelihood without hyperparameters")
    expected = torch.autograd.grad(_reference_log_likelihood(likelihood, f, y).sum(), hyperparameters)
    actual = torch.autograd.grad(log_likelihood(likelihood, f, y).sum(), hyperparameters)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
    for term in (gradient, hessian, hessian_sqrt):
        grads = torch.autograd.grad(term(likelihood, f, y).sum(), hyperparameters)
        assert all(torch.isfinite(grad).all() and grad.abs().sum() > 0 for grad in grads)


def test_inputs_are_not_modified(case):
    likelihood, f, y = case
    f_before, y_before = f.clone(), y.clone()
    for term in (log_likelihood, gradient, hessian, hessian_sqrt):
        term(likelihood, f, y)
    assert torch.equal(f, f_before) and torch.equal(y, y_before)


def test_f_is_not_detached():
    f, y = _data(4, "labels")
    f.requires_grad_(True)
    (grad,) = torch.autograd.grad(log_likelihood(SoftmaxLikelihood(4).double(), f, y).sum(), f)
    torch.testing.assert_close(grad, gradient(SoftmaxLikelihood(4).double(), f.detach(), y))


@pytest.mark.parametrize("name", list(CASES))
def test_float32(name):
    build, num_outputs, kind = CASES[name]
    f64, y64 = _data(num_outputs, kind)
    f32 = f64.float()
    y32 = y64.float() if y64.is_floating_point() else y64
    likelihood32, likelihood64 = build(), build().double()
    # Error model (ε = ε32), first order, a worst case over the roundings' directions (any CPU, any thread count):
    # - the inputs: f and real targets rounded to float32 (ε relative per entry) move each entry t of a term by
    #   at most ε Σ_j |∂t/∂x_j||x_j|, the componentwise condition measured here by autograd in float64;
    # - the evaluation: each entry is a straight-line computation of at most k = 16 roundings (differences,
    #   squares, quotients, exp / log / sqrt, a sum over C ≤ 4 outputs, the float32 hyperparameter transform), each
    #   relative to an intermediate bounded by (1 + max|f| + max|y| + h)(1 + |t|), h the noise variance or the
    #   temperature (log-softmax's f_y − logsumexp f, a Gaussian's (y − f)/σ² formed from y − f = σ²t).
    real_y = y64.is_floating_point()
    if hasattr(likelihood64, "temperature"):
        h = float(likelihood64.temperature.detach())
    elif isinstance(likelihood64, gpytorch.likelihoods.SoftmaxLikelihood):
        h = 1.0
    else:
        h = float(noise_variance(likelihood64).detach().max())
    scale = 1 + f64.abs().max() + (y64.abs().max() if real_y else 0) + h
    for term in (log_likelihood, gradient, hessian, hessian_sqrt):
        value = term(likelihood32, f32, y32)
        assert value.dtype == torch.float32
        expected = term(likelihood64, f64, y64).detach()
        inputs = (f64, y64) if real_y else (f64,)
        jacobians = torch.autograd.functional.jacobian(
            lambda *xs, term=term: term(likelihood64, xs[0], xs[1] if real_y else y64), inputs
        )
        condition = sum(
            (jac.abs() * x.abs()).reshape(*expected.shape, -1).sum(-1) for jac, x in zip(jacobians, inputs)
        )
        bound = EPS32 * (condition + 16 * scale * (1 + expected.abs()))
        assert ((value.double() - expected).abs() <= bound).all(), term.__name__
        assert (bound < 1e-2 * (1 + expected.abs())).all()  # a 1e-2 bug still fails


def test_leading_batch_dimensions():
    f, y = _data(4, "labels")
    likelihood = SoftmaxLikelihood(4).double()
    batched = torch.stack([f, 2 * f])
    for term in (log_likelihood, gradient, hessian, hessian_sqrt):
        value = term(likelihood, batched, y)
        torch.testing.assert_close(value[1], term(likelihood, 2 * f, y))


def test_logistic_terms_stay_finite_for_large_logits():
    f = torch.tensor([[-800.0], [0.0], [800.0]], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    likelihood = LogisticLikelihood().double()
    expected = torch.tensor([-800.0, -math.log(2), -800.0], dtype=torch.float64)
    torch.testing.assert_close(log_likelihood(likelihood, f, y), expected)
    for term in (gradient, hessian, hessian_sqrt):
        assert torch.isfinite(term(likelihood, f, y)).all()
