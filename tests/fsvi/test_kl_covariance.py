"""``kl_covariance="block"`` and ``"diagonal"``: the KL of the per-point blocks or of the variances of the dense
Gaussians from brute-force Jacobians (torch.distributions), their gradients (finite differences), and the
batched ``gaussian_kl`` they rest on."""

from __future__ import annotations

import warnings

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood, MultitaskGaussianLikelihood
from linear_operator.utils.warnings import NumericalWarning
from torch.distributions import MultivariateNormal, Normal, kl_divergence

from ntkgp import metrics
from ntkgp.datasets import gap_regression
from ntkgp.fsvi import FSVI, FSVIOptions, gaussian_kl, train_fsvi

from . import reference as ref
from .test_kl import _dense_gaussians, float32_kl_tolerance
from .test_kl import _model as _kl_model


def _spd(batch, n, g, scale):
    a = torch.randn(*batch, n, n + 2, generator=g, dtype=torch.float64)
    return scale * (a @ a.mT / n + 0.1 * torch.eye(n, dtype=torch.float64))


def test_batched_gaussian_kl_equals_torch_distributions_per_gaussian():
    g = torch.Generator().manual_seed(0)
    mq, mp = (torch.randn(2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    cq, cp = _spd((2, 5), 4, g, 1e-2), _spd((2, 5), 4, g, 1e1)
    for t in (mq, cq, mp, cp):
        t.requires_grad_()
    mine = gaussian_kl(mq, cq, mp, cp)
    expected = kl_divergence(MultivariateNormal(mq, cq), MultivariateNormal(mp, cp))
    assert mine.shape == (2, 5)
    torch.testing.assert_close(mine, expected, rtol=1e-10, atol=1e-10)
    w = torch.randn(2, 5, generator=g, dtype=torch.float64)  # a different weight per Gaussian
    for a, b in zip(torch.autograd.grad((mine * w).sum(), (mq, cq, mp, cp)),
                    torch.autograd.grad((expected * w).sum(), (mq, cq, mp, cp))):
        if a.dim() == 4:  # the analytic gradient is symmetric; autograd's reads the lower triangle
            a, b = a, (b + b.mT) / 2
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_batched_gaussian_kl_jitter_only_where_needed():
    """One singular Gaussian in the batch: the KL is finite, a NumericalWarning is raised, and the
    well-conditioned Gaussians keep their exact KL."""
    g = torch.Generator().manual_seed(1)
    cq = _spd((3,), 3, g, 1.0)
    v = torch.randn(3, 1, generator=g, dtype=torch.float64)
    cq[1] = v @ v.T  # rank one
    cp = _spd((3,), 3, g, 1.0)
    m = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.warns(NumericalWarning):
        kl = gaussian_kl(m, cq, m, cp)
    assert torch.isfinite(kl).all()
    for i in (0, 2):  # GPyTorch's jitter goes only to the Gaussian whose factorization failed
        exact = kl_divergence(MultivariateNormal(m[i], cq[i]), MultivariateNormal(m[i], cp[i]))
        torch.testing.assert_close(kl[i], exact, rtol=1e-10, atol=1e-10)


def test_gaussian_kl_shape_errors():
    with pytest.raises(ValueError, match="expected means"):
        gaussian_kl(torch.zeros(2, 3), torch.eye(3), torch.zeros(2, 3), torch.eye(3).expand(2, 3, 3))
    with pytest.raises(ValueError, match="expected means"):
        gaussian_kl(torch.tensor(0.0), torch.eye(1), torch.tensor(0.0), torch.eye(1))


PRECISIONS = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.7, 1.5])


def _model(c, kl_covariance, prior_mean="zero", linearization="variational_mean", jitter=0.0, seed=0):
    """test_kl's model (μ and s moved off their initial values) with per-parameter precisions and ``kl_covariance``."""
    return _kl_model(c, prior_mean, linearization, prior_precision=PRECISIONS, seed=seed, jitter=jitter,
                     kl_covariance=kl_covariance)


def _blocks(cov, k, c):
    """The K diagonal blocks C × C of an interleaved (K·C)² covariance (rows n·C + c)."""
    return cov.view(k, c, k, c).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


PRIORS = [("zero", "variational_mean"), ("initial", "prior_mean")]


@pytest.mark.parametrize("kind", ["block", "diagonal"])
@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("prior", PRIORS)
@pytest.mark.parametrize("jitter", [0.0, 1e-2])
def test_cheaper_kl_is_the_sum_of_the_points_or_outputs_kls(kind, c, prior, jitter):
    """Block: the sum over points of the C-dimensional KLs of the dense Gaussians' diagonal blocks; diagonal: the
    sum over outputs of the one-dimensional KLs of their variances. No jitter needed on the way."""
    net, model = _model(c, kind, *prior, jitter=jitter)
    x = torch.randn(5, 2, dtype=torch.float64)
    f_q, cov_q, f_p, cov_p = _dense_gaussians(net, model, x, jitter)
    if kind == "block":
        expected = kl_divergence(MultivariateNormal(f_q.view(5, c), _blocks(cov_q, 5, c)),
                                 MultivariateNormal(f_p.view(5, c), _blocks(cov_p, 5, c))).sum()
    else:
        expected = kl_divergence(Normal(f_q, cov_q.diagonal().sqrt()), Normal(f_p, cov_p.diagonal().sqrt())).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        kl = model.function_space_kl(x)
    torch.testing.assert_close(kl, expected, rtol=1e-10, atol=1e-10)


def test_block_kl_on_a_cnn_takes_the_jacobian_route():
    net = ref.small_cnn(3)
    model = FSVI(net, MultitaskGaussianLikelihood(3, rank=0).double(), prior_mean="initial",
                 prior_linearization="prior_mean", init_std=0.1, context_jitter=0.0, kl_covariance="block")
    with torch.no_grad():
        for m in model.variational_distribution.mean:
            m.add_(0.2 * torch.randn_like(m))
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    f_q, cov_q, f_p, cov_p = _dense_gaussians(net, model, x, 0.0)
    expected = kl_divergence(MultivariateNormal(f_q.view(4, 3), _blocks(cov_q, 4, 3)),
                             MultivariateNormal(f_p.view(4, 3), _blocks(cov_p, 4, 3))).sum()
    torch.testing.assert_close(model.function_space_kl(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["block", "diagonal"])
def test_gradients_match_finite_differences(kind):
    """∂KL/∂μ and ∂KL/∂(raw s) by autograd against central differences along random directions (without
    context jitter, whose size is held constant within a step by design)."""
    _, model = _model(3, kind)
    x = torch.randn(4, 2, dtype=torch.float64)
    q = model.variational_distribution
    params = list(q.mean) + list(q.raw_std)
    groups = (range(len(q.mean)), range(len(q.mean), len(params)))
    ref.check_directional_derivatives(lambda: model.function_space_kl(x), params, groups, directions=3,
                                      generator=torch.Generator().manual_seed(3))


def test_orderings_of_the_kls():
    """At the same μ, s and context points the three KLs differ (the block and diagonal KLs drop the
    cross-covariances): a check that the option is applied, not only accepted."""
    values = {}
    for kind in ("full", "block", "diagonal"):
        _, model = _model(3, kind, jitter=1e-2, seed=2)
        values[kind] = model.function_space_kl(torch.randn(4, 2, dtype=torch.float64,
                                                           generator=torch.Generator().manual_seed(0))).item()
    assert len({round(v, 8) for v in values.values()}) == 3


def test_block_and_diagonal_agree_for_one_output():
    x = torch.randn(6, 2, dtype=torch.float64)
    kls = [_model(1, kind, jitter=1e-2)[1].function_space_kl(x) for kind in ("block", "diagonal")]
    torch.testing.assert_close(kls[0], kls[1], rtol=1e-10, atol=1e-12)


def test_unknown_kl_covariance_is_refused_before_anything_is_built():
    net = ref.mlp(d_in=2, width=5, d_out=1)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    with pytest.raises(ValueError, match="kl_covariance"):
        FSVI(net, GaussianLikelihood().double(), kl_covariance="dense")
    x = torch.randn(8, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="kl_covariance"):
        train_fsvi(net, x, x[:, 0], GaussianLikelihood().double(),
                   options=FSVIOptions(kl_covariance="blocks"), epochs=1, progress=False)
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n])


@pytest.mark.parametrize("argument, value", [("kl_covariance", "blocks"), ("context_jitter", -1.0),
                                             ("prior_linearization", "nowhere"), ("init_std", -1.0),
                                             ("strategy", "magic"), ("prior_precision", -2.0)])
def test_train_fsvi_checks_the_model_options_before_reading_a_loader(argument, value):
    """Reading a loader is a side effect (a shuffling DataLoader draws from the global generator): every option
    of the model is checked first."""
    x = torch.randn(8, 2, dtype=torch.float64)

    class Loader:
        read = False

        def __iter__(self):
            Loader.read = True
            yield x, x[:, 0]

    settings = {argument: value} if argument == "prior_precision" else {"options": FSVIOptions(**{argument: value})}
    with pytest.raises(ValueError, match=argument):
        train_fsvi(ref.mlp(d_in=2, width=5, d_out=1), Loader(), None, GaussianLikelihood().double(),
                   progress=False, **settings)
    assert not Loader.read


@pytest.mark.slow
def test_gap_regression_in_between_uncertainty():
    """The setting of test_training's gap test (2×50 ReLU, 1000 full-batch steps, K = 32), with the diagonal KL
    (for C = 1 the same as the block KL): the predictive standard deviation in the gap still exceeds the one on
    the data, by less than with the full KL (measured: 1.48 against about 4; the points' cross-covariances are
    what the full KL makes the prior's)."""
    kind = "diagonal"
    d = gap_regression(n=60, noise_std=0.1, seed=0)
    lik = GaussianLikelihood().double()
    lik.noise = 0.01
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.ReLU(), torch.nn.Linear(50, 50), torch.nn.ReLU(),
                              torch.nn.Linear(50, 1)).double()
    res = train_fsvi(net, d.x_train, d.y_train, lik, prior_precision=torch.tensor([1.0, 50.0, 50.0]), epochs=1000,
                     batch_size=None, lr=1e-2, num_context=32,
                     options=FSVIOptions(context_jitter=1e-6, kl_covariance=kind),
                     progress=False)
    assert res.model.kl_covariance == kind
    x = torch.linspace(-1, 1, 41, dtype=torch.float64)[:, None]
    with torch.no_grad():
        std = res.model(x).variance.sqrt()
        mean = res.model(d.x_train).mean
    gap, on_data = x.abs().squeeze() < 0.2, ((x.abs() > 0.45) & (x.abs() < 0.9)).squeeze()
    assert metrics.rmse(mean, d.y_train) < 0.15
    assert std[gap].mean() > 1.3 * std[on_data].mean()


@pytest.mark.parametrize("kind", ["block", "diagonal"])
def test_float32_close_to_float64(kind):
    net64, model64 = _model(3, kind, jitter=1e-2)
    net32 = ref.mlp(d_in=2, width=5, d_out=3, seed=0, dtype=torch.float32)
    model32 = FSVI(net32, MultitaskGaussianLikelihood(3, rank=0), prior_structure="parameter",
                   prior_precision=PRECISIONS, kl_covariance=kind)
    model32.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in model64.state_dict().items()},
                            strict=False)
    x = torch.randn(6, 2, dtype=torch.float64)
    kl32 = model32.function_space_kl(x.float())
    assert kl32.dtype == torch.float32
    kl64 = model64.function_space_kl(x)
    # the error model of tests.helpers.float32_gaussian_kl_tolerance (ε32 times the KL's condition, measured here)
    tol = float32_kl_tolerance(net64, model64, x, jitter=1e-2, kind=kind)
    assert tol < 1e-2 * abs(kl64.item())  # a meaningful bound: a 1 % error fails
    assert abs(kl32.double().item() - kl64.item()) <= tol
