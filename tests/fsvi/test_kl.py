"""The function-space KL against torch.distributions with dense Gaussians from brute-force Jacobians."""

from __future__ import annotations

import warnings

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood, MultitaskGaussianLikelihood
from linear_operator.utils.warnings import NumericalWarning
from torch.distributions import MultivariateNormal, kl_divergence
from torch.func import functional_call

from ntkgp.fsvi import FSVI, gaussian_kl
from tests.helpers import EPS32, float32_gaussian_kl_tolerance, float32_roundings

from . import reference as ref


def _random_spd(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n + 3, generator=g, dtype=dtype)
    return a @ a.T / n + 0.1 * torch.eye(n, dtype=dtype)


def test_gaussian_kl_equals_torch_distributions():
    g = torch.Generator().manual_seed(0)
    for n in (1, 4, 9):
        mq, mp = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
        cq, cp = _random_spd(n, 1) * 1e-3, _random_spd(n, 2) * 1e2  # very different scales
        expected = kl_divergence(MultivariateNormal(mq, cq), MultivariateNormal(mp, cp))
        torch.testing.assert_close(gaussian_kl(mq, cq, mp, cp), expected, rtol=1e-10, atol=1e-10)


def test_gaussian_kl_gradients_equal_torch_distributions():
    mq = torch.randn(5, dtype=torch.float64, requires_grad=True)
    cq, cp = _random_spd(5, 3).requires_grad_(), _random_spd(5, 4).requires_grad_()
    mp = torch.randn(5, dtype=torch.float64)
    mine = torch.autograd.grad(gaussian_kl(mq, cq, mp, cp), (mq, cq, cp))
    theirs = torch.autograd.grad(kl_divergence(MultivariateNormal(mq, cq), MultivariateNormal(mp, cp)), (mq, cq, cp))
    for a, b in zip(mine, theirs):
        # the Cholesky route sees only the lower triangle: compare the symmetrized gradients
        a, b = (a + a.mT) / 2 if a.dim() == 2 else a, (b + b.mT) / 2 if b.dim() == 2 else b
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_gaussian_kl_analytic_gradient_passes_gradcheck():
    """The hand-written backward of the KL (all four arguments) against finite differences; the matrices enter
    symmetrized, as the factorization reads one triangle."""
    mq, mp = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    cq, cp = _random_spd(4, 5), _random_spd(4, 6) * 3

    def kl(a, b, c, d):
        return gaussian_kl(a, (b + b.mT) / 2, c, (d + d.mT) / 2)

    assert torch.autograd.gradcheck(kl, tuple(t.clone().requires_grad_() for t in (mq, cq, mp, cp)))


def test_gaussian_kl_gradient_with_jitter_is_that_of_the_jittered_matrices():
    """A singular covariance takes GPyTorch's jitter (warned): value and gradient are those of the KL of
    Σ + ε diag(Σ) with the ε reported in the warning, computed by torch.distributions."""
    import re

    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 2, generator=g, dtype=torch.float64)
    cq = (a @ a.T + torch.diag(torch.tensor([0.0, 0, 0, 0, 1e-3], dtype=torch.float64))).requires_grad_()
    cp = _random_spd(5, 7).requires_grad_()
    mq, mp = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = gaussian_kl(mq, cq, mp, cp)
    jitter = [w for w in caught if issubclass(w.category, NumericalWarning)]
    assert jitter, "the singular covariance should have needed jitter"
    eps = float(re.search(r"jitter of ([0-9.e+-]+)", str(jitter[-1].message)).group(1))
    mine = torch.autograd.grad(value, (cq, cp))
    jittered = cq + eps * torch.diag(cq.diagonal())
    expected = kl_divergence(MultivariateNormal(mq, jittered), MultivariateNormal(mp, cp))
    torch.testing.assert_close(value, expected, rtol=1e-8, atol=1e-8)
    theirs = torch.autograd.grad(expected, (cq, cp))
    for x, y in zip(mine, theirs):  # condition number ~1/ε: agreement to rounding times it
        torch.testing.assert_close((x + x.mT) / 2, (y + y.mT) / 2, rtol=1e-4, atol=1e-6)


def test_gaussian_kl_errors():
    with pytest.raises(ValueError, match="expected means"):
        gaussian_kl(torch.zeros(2), torch.eye(3), torch.zeros(2), torch.eye(2))
    with pytest.raises(ValueError, match="cov_q"):
        gaussian_kl(torch.zeros(2), torch.zeros(2, 2), torch.zeros(2), torch.eye(2))


def _model(c, prior_mean, prior_linearization, prior_precision=1.0, seed=0, jitter=0.0, kl_covariance="full"):
    net = ref.mlp(d_in=2, width=5, d_out=c, seed=seed)
    lik = GaussianLikelihood().double() if c == 1 else MultitaskGaussianLikelihood(c, rank=0).double()
    model = FSVI(net, lik, prior_precision=prior_precision, prior_mean=prior_mean,
                 prior_linearization=prior_linearization, prior_structure="parameter", context_jitter=jitter,
                 kl_covariance=kl_covariance)
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():  # move μ and s away from their initial values: every term of the KL matters
        for m, t in zip(model.variational_distribution.mean, model.variational_distribution.raw_std):
            m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=m.dtype))
            t.copy_(-1.0 + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    return net, model


def _dense_gaussians(net, model, x, jitter=0.0):
    """Means ``(K·C,)`` and covariances ``(K·C)²`` of q and p on the context points (rows n·C + c), by
    brute-force Jacobians, with the shared context noise."""
    q, p = model.variational_distribution, model.prior
    names = q.names
    mu = {n: t.detach() for n, t in q.means().items()}
    mu0 = p.means()
    var_q = {n: t.detach() for n, t in q.variances().items()}
    var_p = {n: t.expand(mu[n].shape) for n, t in p.variances().items()}
    at = mu if p.prior_linearization == "variational_mean" else mu0
    cov_q = ref.covariance(net, mu, var_q, names, x)
    cov_p = ref.covariance(net, at, var_p, names, x)
    f_q = functional_call(net, mu, (x,)).reshape(-1)
    if p.prior_linearization == "variational_mean":  # the prior's linearization about μ: f(μ) + J_μ (μ0 - μ)
        f_p = f_q + ref.jacobian(net, mu, names, x) @ (ref.flat(mu0, names) - ref.flat(mu, names))
    else:
        f_p = functional_call(net, mu0, (x,)).reshape(-1)
    noise = jitter * cov_p.diagonal().mean() * torch.eye(cov_p.shape[0], dtype=cov_p.dtype)
    return f_q, cov_q + noise, f_p, cov_p + noise


def _dense_kl(net, model, x, jitter=0.0):
    f_q, cov_q, f_p, cov_p = _dense_gaussians(net, model, x, jitter)
    return kl_divergence(MultivariateNormal(f_q, cov_q), MultivariateNormal(f_p, cov_p))


def float32_kl_tolerance(net, model, x, jitter=0.0, kind="full") -> float:
    """The first-order bound of :func:`tests.helpers.float32_gaussian_kl_tolerance` on a float32 copy's
    ``function_space_kl(x)`` (``kind``: the full Gaussians, their K blocks C × C, or their variances), from the
    dense float64 Gaussians. The means f(μ) and the prior's (f(μ0), or f(μ) + J_μ(μ0 − μ)) carry
    |Δf| ≤ rε(|f| + ‖J‖‖θ‖) (tests.helpers.float32_roundings), so ‖Δ(μ_q − μ_p)‖ ≤ rε(‖f_q‖ + ‖f_p‖
    + ‖J_μ‖_F(‖μ‖ + ‖μ0 − μ‖) + ‖J_μ0‖_F‖μ0‖)."""
    f_q, cov_q, f_p, cov_p = _dense_gaussians(net, model, x, jitter)
    q, p = model.variational_distribution, model.prior
    names = q.names
    mu = {n: t.detach() for n, t in q.means().items()}
    mu0 = {n: t.detach() for n, t in p.means().items()}
    r = float32_roundings(net)
    flat_mu, flat_mu0 = ref.flat(mu, names), ref.flat(mu0, names)
    mean_error = r * EPS32 * (f_q.norm() + f_p.norm()
                              + ref.jacobian(net, mu, names, x).norm() * (flat_mu.norm() + (flat_mu0 - flat_mu).norm())
                              + ref.jacobian(net, mu0, names, x).norm() * flat_mu0.norm()).item()
    d = f_q - f_p
    if kind == "full":
        return float32_gaussian_kl_tolerance(d, cov_q, cov_p, r, mean_error)
    k = x.shape[0]
    c = d.numel() // k
    if kind == "block":
        blocks = [cov.view(k, c, k, c).diagonal(dim1=0, dim2=2).permute(2, 0, 1) for cov in (cov_q, cov_p)]
        return float32_gaussian_kl_tolerance(d.view(k, c), *blocks, r, mean_error)
    return float32_gaussian_kl_tolerance(d[:, None], cov_q.diagonal()[:, None, None], cov_p.diagonal()[:, None, None],
                                         r, mean_error)


PRIORS = [("zero", "variational_mean"), ("mapping", "variational_mean"), ("initial", "prior_mean"),
          ("mapping", "prior_mean")]


@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("prior", PRIORS)
def test_function_space_kl_equals_dense_gaussians(c, prior):
    prior_mean, linearization = prior
    net = ref.mlp(d_in=2, width=5, d_out=c, seed=7)
    if prior_mean == "mapping":
        prior_mean = {n: 0.5 * torch.randn_like(p) for n, p in net.named_parameters()}
    net, model = _model(c, prior_mean, linearization, prior_precision=torch.tensor([0.5, 2.0, 1.0, 3.0, 0.7, 1.5]))
    x = torch.randn(4, 2, dtype=torch.float64)  # K·C = 4 or 12 < P = 51: both covariances non-singular
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)  # no jitter was needed here
        kl = model.function_space_kl(x)
    torch.testing.assert_close(kl, _dense_kl(net, model, x), rtol=1e-10, atol=1e-10)


def test_function_space_kl_cnn():
    net = ref.small_cnn(3)
    model = FSVI(net, MultitaskGaussianLikelihood(3, rank=0).double(), prior_mean="initial",
                 prior_linearization="prior_mean", init_std=0.1, context_jitter=0.0)
    with torch.no_grad():
        for m in model.variational_distribution.mean:
            m.add_(0.2 * torch.randn_like(m))
    x = torch.randn(3, 1, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(model.function_space_kl(x), _dense_kl(net, model, x), rtol=1e-10, atol=1e-10)


def test_float32_close_to_float64():
    net64, model64 = _model(3, "zero", "variational_mean", jitter=1e-2)
    net32 = ref.mlp(d_in=2, width=5, d_out=3, seed=0, dtype=torch.float32)
    model32 = FSVI(net32, MultitaskGaussianLikelihood(3, rank=0), prior_mean="zero", prior_structure="parameter")
    model32.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in model64.state_dict().items()},
                            strict=False)
    x = torch.randn(4, 2, dtype=torch.float64)
    kl64 = model64.function_space_kl(x)
    kl32 = model32.function_space_kl(x.float())
    assert kl32.dtype == torch.float32
    tol = float32_kl_tolerance(net64, model64, x, jitter=1e-2)  # the error model: ε32 times the KL's condition
    assert tol < 1e-2 * abs(kl64.item())  # a meaningful bound: a 1 % error fails
    assert abs(kl32.double().item() - kl64.item()) <= tol


def test_singular_covariance_gets_warned_jitter():
    """K·C > P: the linearized covariances are singular; jitter is added and a NumericalWarning says so."""
    net = ref.mlp(d_in=1, width=2, d_out=1, depth=1)  # P = 7
    model = FSVI(net, GaussianLikelihood().double(), context_jitter=0.0)
    x = torch.linspace(-1, 1, 12, dtype=torch.float64)[:, None]
    with pytest.warns(NumericalWarning):
        kl = model.function_space_kl(x)
    assert torch.isfinite(kl)


@pytest.mark.parametrize("c", [1, 3])
def test_context_jitter_is_shared_noise(c):
    net, model = _model(c, "zero", "variational_mean", jitter=1e-2)
    x = torch.randn(6, 2, dtype=torch.float64)
    torch.testing.assert_close(model.function_space_kl(x), _dense_kl(net, model, x, 1e-2), rtol=1e-10, atol=1e-10)


def test_context_jitter_removes_null_directions():
    """K·C > P: with shared noise the KL is finite without Cholesky jitter and is the KL on the noisy outputs."""
    net = ref.mlp(d_in=1, width=2, d_out=1, depth=1)
    model = FSVI(net, GaussianLikelihood().double(), context_jitter=1e-3)
    x = torch.linspace(-1, 1, 12, dtype=torch.float64)[:, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        kl = model.function_space_kl(x)
    torch.testing.assert_close(kl, _dense_kl(net, model, x, 1e-3), rtol=1e-8, atol=1e-8)


def test_degenerate_prior_is_refused():
    with pytest.raises(ValueError, match="degenerate"):
        FSVI(ref.mlp(), GaussianLikelihood().double(), prior_mean="zero", prior_linearization="prior_mean")
