"""SFR prediction: batched inputs, input gradients (vs central finite differences), chunking with bounded
memory, a covariance operator whose products never form the dense matrix, and BoTorch's ``posterior``."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch
from torch import nn

from ntkgp.models.sfr import SFR, prediction_terms
from ntkgp.models.sfr.prediction_terms import PredictiveTerms
from tests.helpers import rel_err, small_cnn
from tests.models.sfr.problems import DELTA, dense_moments, problem

CASES = [("gaussian", 1, "joint", "linearized"), ("softmax", 3, "joint", "linearized"), ("softmax", 3, "independent", "zero")]


def model(kind, c, coupling, mean, **kw):
    net, x, y, lik, xs = problem(kind, c, n=16)
    return SFR(net, x, y, lik, num_inducing=6, prior_precision=DELTA, output_coupling=coupling, prior_mean=mean, **kw), xs


@pytest.mark.parametrize("kind,c,coupling,mean", CASES)
def test_batched_inputs_give_the_joint_posterior_of_each_batch(kind, c, coupling, mean):
    sfr, xs = model(kind, c, coupling, mean)
    xb = torch.randn(2, 3, 4, xs.shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dist = sfr(xb)
    assert dist.batch_shape == torch.Size([2, 3])
    dense = dist.covariance_matrix
    for i in range(2):
        for j in range(3):
            ref_mean, ref_cov = dense_moments(sfr(xb[i, j]))
            assert rel_err(dist.mean[i, j].reshape(-1), ref_mean) < 1e-12
            assert rel_err(dense[i, j], ref_cov) < 1e-12
            assert rel_err(dist.variance[i, j].reshape(-1), ref_cov.diagonal()) < 1e-12
    assert rel_err(dist[1, 2].covariance_matrix, dense[1, 2]) < 1e-12  # batch indexing of the lazy operator


def assert_matches_central_differences(fn, x, grad, directions=3, eps=1e-6, tol=1e-7):
    """``grad · v`` against ``(fn(x + εv) − fn(x − εv)) / 2ε`` for random unit directions ``v`` (float64)."""
    g = torch.Generator().manual_seed(11)
    for _ in range(directions):
        v = torch.randn(x.shape, dtype=x.dtype, generator=g)
        v = v / v.norm()
        with torch.no_grad():
            reference = (fn(x + eps * v) - fn(x - eps * v)) / (2 * eps)
        assert abs((grad * v).sum().item() - reference.item()) < tol * max(1.0, abs(reference.item()))


@pytest.mark.parametrize("kind,c,coupling,mean", CASES + [("softmax", 3, "joint", "nn")])
def test_input_gradients_of_mean_and_variance_match_finite_differences(kind, c, coupling, mean):
    predictive_mean = "nn" if mean == "nn" else "gp"
    sfr, xs = model(kind, c, coupling, "linearized" if mean == "nn" else mean, predictive_mean=predictive_mean)
    w = torch.randn(xs.shape[0], c, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def scalar(x, part):
        dist = sfr(x)
        values = dist.mean if part == "mean" else dist.variance
        return (values.reshape(w.shape) * w).sum()

    for part in ("mean", "variance"):
        x = xs.clone().requires_grad_(True)
        value = scalar(x, part)
        (grad,) = torch.autograd.grad(value, x)
        with torch.no_grad():
            assert abs(value.item() - scalar(xs, part).item()) < 1e-12  # both routes give the same value
        assert_matches_central_differences(lambda z, part=part: scalar(z, part), xs, grad)


def test_input_gradient_of_the_full_covariance_and_products():
    sfr, xs = model("softmax", 3, "joint", "linearized")
    rhs = torch.randn(xs.shape[0] * 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def dense(x):
        return sfr(x).covariance_matrix.sum()

    def product(x):
        return (sfr(x, chunk_size=2).lazy_covariance_matrix.matmul(rhs)).sum()

    for fn in (dense, product):
        x = xs.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(fn(x), x)
        assert_matches_central_differences(fn, xs, grad)


def test_input_gradients_of_a_cnn_match_finite_differences():
    net = small_cnn(2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 1, 6, 6, dtype=torch.float64, generator=g)
    with torch.no_grad():
        y = net(x).argmax(-1)
    from ntkgp.likelihoods import SoftmaxLikelihood

    sfr = SFR(net, x, y, SoftmaxLikelihood(2).double(), num_inducing=4)
    xs = torch.randn(2, 1, 6, 6, dtype=torch.float64, generator=g)

    def scalar(z):
        dist = sfr(z)
        return dist.mean.sum() + dist.variance.sum()

    z = xs.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(scalar(z), z)
    assert_matches_central_differences(scalar, xs, grad, tol=1e-6)


@pytest.mark.parametrize("kind,c,coupling,mean", CASES)
def test_chunked_prediction_equals_one_chunk_and_products_never_densify(kind, c, coupling, mean):
    sfr, xs = model(kind, c, coupling, mean)
    whole = sfr(xs)
    chunked = sfr(xs, chunk_size=2)
    assert chunked.lazy_covariance_matrix.low_rank_z is None  # factors are recomputed, not kept
    rhs = torch.randn(xs.shape[0] * c, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    dense = whole.covariance_matrix
    with mock.patch.object(PredictiveTerms, "prior_dense", side_effect=AssertionError("dense matrix formed")):
        for dist in (whole, chunked):
            assert rel_err(dist.lazy_covariance_matrix.matmul(rhs), dense @ rhs) < 1e-12
            assert rel_err(dist.lazy_covariance_matrix.matmul(rhs[:, 0]), dense @ rhs[:, 0]) < 1e-12
            assert rel_err(dist.variance.reshape(-1), dense.diagonal()) < 1e-12
            assert rel_err(dist.mean, whole.mean) < 1e-12
    assert rel_err(chunked.covariance_matrix, dense) < 1e-12


def test_prediction_memory_is_bounded_by_the_chunk():
    """Every cross-Gram is computed for at most ``chunk_size`` test points, and the predictive keeps only
    per-point quantities (mean, C×C blocks) plus the inputs when there is more than one chunk."""
    sfr, _ = model("softmax", 3, "joint", "linearized")
    xs = torch.randn(50, 3, dtype=torch.float64)
    sizes: list[int] = []
    original = prediction_terms.system_grams_and_diagonal

    def spy(engine, z, x, coupling, *args, **kwargs):
        sizes.append(x.shape[0])
        return original(engine, z, x, coupling, *args, **kwargs)

    with mock.patch.object(prediction_terms, "system_grams_and_diagonal", side_effect=spy):
        dist = sfr(xs, chunk_size=8)
        _ = dist.variance
    assert sizes and max(sizes) <= 8
    op = dist.lazy_covariance_matrix
    stored = [t for t in op.representation()]
    assert sum(t.numel() for t in stored) == xs.numel() + 50 * 3 * 3
    factors = []  # the chunks' low-rank factors (b·M·C² numbers each) must not outlive their chunk
    original_chunk = PredictiveTerms.chunk

    def recording_chunk(self, x, pieces=None):
        gc.collect()
        assert all(ref() is None for ref in factors), "an earlier chunk's factors are still held"
        part = original_chunk(self, x, pieces)
        factors.append(weakref.ref(part.low_rank_z))
        return part

    with mock.patch.object(PredictiveTerms, "chunk", recording_chunk):
        sfr(xs, chunk_size=8)
    assert len(factors) == 7
    sfr.batch_size = 16  # the default chunk is the accumulation step
    sizes.clear()
    with mock.patch.object(prediction_terms, "system_grams_and_diagonal", side_effect=spy):
        sfr(xs)
    assert max(sizes) == 16


def test_probit_and_monte_carlo_read_only_point_blocks():
    sfr, xs = model("softmax", 3, "joint", "linearized")
    dist = sfr(xs, chunk_size=2)
    with mock.patch.object(PredictiveTerms, "prior_dense", side_effect=AssertionError("dense matrix formed")):
        probs = sfr.likelihood(dist).probs
        mc = sfr.likelihood(dist, link_approx="mc", num_samples=2000, generator=torch.Generator().manual_seed(0)).probs
    assert probs.shape == (xs.shape[0], 3) and (mc - probs).abs().max() < 0.1


def test_botorch_posterior_equals_the_model_and_drives_acquisition():
    pytest.importorskip("botorch")
    from botorch.acquisition import LogExpectedImprovement, UpperConfidenceBound
    from botorch.acquisition.objective import ScalarizedPosteriorTransform
    from botorch.posteriors.gpytorch import GPyTorchPosterior

    sfr, _ = model("gaussian", 2, "joint", "linearized")
    X = torch.randn(4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    dist = sfr(X)
    post = sfr.posterior(X)
    assert isinstance(post, GPyTorchPosterior) and post.mean.shape == (4, 2, 2)
    assert rel_err(post.mean, dist.mean) < 1e-12 and rel_err(post.variance, dist.variance) < 1e-12
    one = sfr.posterior(X, output_indices=[1])
    assert rel_err(one.mean[..., 0], dist.mean[..., 1]) < 1e-12
    rows = torch.arange(2) * 2 + 1
    assert rel_err(one.distribution.covariance_matrix, dist.covariance_matrix[:, rows][:, :, rows]) < 1e-12
    noisy = sfr.posterior(X, observation_noise=True)
    assert rel_err(noisy.variance - post.variance, sfr.likelihood.task_noises.expand(4, 2, 2)) < 1e-12
    noise = torch.full((4, 2, 2), 0.05, dtype=torch.float64)
    assert rel_err(sfr.posterior(X, observation_noise=noise).variance - post.variance, noise) < 1e-12
    weights = torch.tensor([1.0, -2.0], dtype=torch.float64)
    scal = sfr.posterior(X, posterior_transform=ScalarizedPosteriorTransform(weights))
    assert rel_err(scal.mean[..., 0], dist.mean @ weights) < 1e-12

    reg, _ = model("gaussian", 1, "joint", "linearized")
    Xq = X[:, :1].clone().requires_grad_(True)
    ucb = UpperConfidenceBound(reg, beta=4.0)(Xq)
    d = reg(Xq)
    assert rel_err(ucb, d.mean.squeeze(-1) + 2.0 * d.variance.squeeze(-1).sqrt()) < 1e-12
    ucb.sum().backward()
    assert Xq.grad is not None and torch.isfinite(Xq.grad).all()
    assert torch.isfinite(LogExpectedImprovement(reg, best_f=0.5)(X[:, :1])).all()


def test_observation_noise_needs_a_gaussian_likelihood():
    pytest.importorskip("botorch")
    sfr, xs = model("softmax", 3, "joint", "linearized")
    with pytest.raises(ValueError, match="Gaussian likelihood"):
        sfr.posterior(xs[None], observation_noise=True)


def test_batched_classification_predictive_and_dtype_conversion():
    from ntkgp.likelihoods import SoftmaxLikelihood
    from tests.helpers import mlp

    net, x, y, _, xs = problem("softmax", 3, n=16)
    net32 = mlp(3, 6, 3, depth=2, seed=0).float()
    net32.load_state_dict({k: v.float() for k, v in net.state_dict().items()})
    sfr = SFR(net32, x.float(), y, SoftmaxLikelihood(3), num_inducing=6)
    xb = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(6))
    probs = sfr.likelihood(sfr(xb)).probs
    assert probs.shape == (2, 4, 3)
    # Error model (tests/models/sfr/float32_bounds.py): each call is the float64 model at float32-rounded features and
    # outputs of its test points, within ``bound`` of the float64 SFR per entry (probit link); the two calls differ
    # only in the batch shape those were computed in, so they are within twice that bound of each other
    from tests.models.sfr.float32_bounds import float32_sfr_bounds, probit_probability_bound

    b = float32_sfr_bounds(net32, x.float(), y, sfr.inducing_points, xb[1], "softmax")
    bound = probit_probability_bound(b["mean"], b["variance"], b["mean_bound"], b["variance_bound"])
    assert ((probs[1].double() - sfr.likelihood(sfr(xb[1])).probs.double()).abs() <= 2 * bound).all()
    before = sfr(xs)
    sfr.double()  # the model's buffers and hyperparameters; the network stays float32
    after = sfr(xs)
    assert after.mean.dtype == torch.float64 and next(net32.parameters()).dtype == torch.float32
    # Error model: SFR computes its predictive terms in its statistics' dtype, float64, from the float32 network's
    # features in both calls (the hyperparameters' float32 values are converted exactly), and returns them in the
    # model's dtype: `before` is `after` rounded to float32, |Δ| ≤ (ε32/2)|after| per entry. The bound allows
    # ε32|after|, the other half for a float64 recomputation (rounding at ε64 = 1.1e-16 relative times the
    # conditioning of these small systems), on any CPU and thread count; a converted model that recomputes with
    # other values (a stale buffer, a 1e-2 bug) fails.
    eps = torch.finfo(torch.float32).eps
    for moment in ("mean", "variance"):
        now, then = getattr(after, moment), getattr(before, moment).double()
        assert bool(((now - then).abs() <= eps * now.abs()).all()), moment
