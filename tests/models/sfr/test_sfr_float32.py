"""float32 SFR against the same SFR on a float64 copy of the network (issue 27, item 2).

A float32 network gives float32 features of the data and test points; SFR computes the features of Z on a float64
copy of the network, contracts the float32 ones against them in float64, sums its statistics and factorizes in
float64, and returns the network plus a correction as the mean. The reference is the same model (same weights,
exactly, and the same Z) computed from a float64 network: equal inducing rank where the float64 model has full
rank; means, variances, probabilities and evidence within the bounds of the first-order error model of
float32_bounds.py (the float32 model is the float64 one at rounded Jacobian rows, outputs and sites; the bounds
are below 1 % of the values, and a 1 % error fails them); the same decisions outside near-ties; a
NumericalWarning where float32 truly loses precision, and not otherwise.
"""

from __future__ import annotations

import copy
import functools
import re
import warnings

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.likelihoods.link_approximation import softmax_probit
from ntkgp.linalg import NumericalWarning
from ntkgp.models.sfr import SFR
from ntkgp.models.sfr.variance_precision import VARIANCE_ERROR_LIMIT
from tests.helpers import EPS32, mlp, rel_err, small_cnn
from tests.models.sfr.float32_bounds import float32_sfr_bounds, probit_probability_bound


def likelihood(kind: str, c: int, dtype: torch.dtype, noise: float = 0.1):
    if kind == "softmax":
        return SoftmaxLikelihood(c).to(dtype)
    lik = GaussianLikelihood().to(dtype)
    lik.noise = noise
    return lik


def pair(net32, x, y, xs, kind, c, noise=0.1, **kw):
    """The float32 model, its float64 twin (same weights in float64, same Z) and both predictives; the float32
    model is built and evaluated with warnings recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NumericalWarning)
        sfr32 = SFR(net32, x, y, likelihood(kind, c, torch.float32, noise), **kw)
        d32 = sfr32(xs)
        rank32 = sfr32.inducing_rank
    kw.pop("num_inducing", None)
    kw["inducing_points"] = sfr32.inducing_points.double()
    y64 = y.double() if y.is_floating_point() else y
    sfr64 = SFR(copy.deepcopy(net32).double(), x.double(), y64, likelihood(kind, c, torch.float64, noise), **kw)
    d64 = sfr64(xs.double())
    numerical = [w for w in caught if issubclass(w.category, NumericalWarning)]
    return sfr32, sfr64, d32, d64, rank32, numerical


def same_decisions(p32, p64, error) -> bool:
    """The float32 model decides as the float64 copy wherever the copy's top two probabilities are more than
    ``2·error`` apart (``error`` bounds |p32 − p64|, per point): two computations agree on a decision only outside a
    near-tie."""
    top = p64.topk(2, dim=-1).values
    clear = (top[..., 0] - top[..., 1]) > 2 * error
    return bool((p32.argmax(-1) == p64.argmax(-1))[clear].all())


def error_model(net, x, y, xs, sfr32, sfr64, kind="softmax", coupling="joint", prior_mean="linearized", delta=1.0,
                noise=None) -> dict:
    """The float32 model's errors against the float64 copy, each as a fraction of its bound from the error model of
    tests/models/sfr/float32_bounds.py (per test point and output; ≤ 1 where the model holds), and the bounds'
    size (``relative``: normwise, as a fraction of the float64 values). The dense float64 reference of that module
    is first checked to be the same model as the library's float64 copy: two float64 computations, whose difference
    (float64 rounding amplified by κ(K_ZZ), a term of the error model) is within the bounds (a model defined
    differently would be off by far more)."""
    b = float32_sfr_bounds(net, x, y, sfr32.inducing_points, xs, kind, coupling, prior_mean, delta, noise)
    with torch.no_grad():
        d32, d64 = sfr32(xs), sfr64(xs.double())
        m64, v64 = d64.mean.reshape(b["mean"].shape), d64.variance.reshape(b["mean"].shape)
        m32, v32 = d32.mean.double().reshape(m64.shape), d32.variance.double().reshape(m64.shape)
        assert ((b["mean"] - m64).abs() <= b["mean_bound"]).all()
        assert ((b["variance"] - v64).abs() <= b["variance_bound"]).all()
        out = {"mean": m32, "variance": v32, "float64": (m64, v64), "bounds": b,
               "evidence": (sfr32.log_marginal_likelihood().item(), sfr64.log_marginal_likelihood().item())}
        if kind == "softmax":
            out["probs"] = (sfr32.likelihood(d32).probs.double(), sfr64.likelihood(d64).probs)
    out["relative"] = {"mean": (b["mean_bound"].norm() / m64.norm()).item(),
                       "variance": (b["variance_bound"].norm() / v64.norm()).item()}
    return out


def ratios(case: dict, mean=None, variance=None, evidence=None) -> dict:
    """The largest error / bound of the mean, variance, probabilities (probit, from the mean and variance bounds)
    and evidence (``mean``, ``variance``, ``evidence``: float32 values to check instead of the model's, for the test
    that a 1 % error fails)."""
    b, (m64, v64) = case["bounds"], case["float64"]
    mean = case["mean"] if mean is None else mean
    variance = case["variance"] if variance is None else variance
    l32, l64 = case["evidence"] if evidence is None else (evidence, case["evidence"][1])
    out = {"mean": ((mean - m64).abs() / b["mean_bound"]).max().item(),
           "variance": ((variance - v64).abs() / b["variance_bound"]).max().item(),
           "evidence": abs(l32 - l64) / b["evidence_bound"]}
    if "probs" in case:
        p32, p64 = (softmax_probit(mean, variance), case["probs"][1]) if mean is not case["mean"] else case["probs"]
        bound = probit_probability_bound(m64, v64, b["mean_bound"], b["variance_bound"])
        out["probs"] = ((p32 - p64).abs() / bound).max().item()
        out["decisions"] = same_decisions(p32, p64, bound.amax(-1))
    return out


def trained_classifier(seed=1):
    torch.manual_seed(seed)
    x, xs = torch.randn(200, 4), torch.randn(100, 4)
    net = mlp(4, 32, 3, depth=2, dtype=torch.float32, seed=seed)
    with torch.no_grad():
        y = net(x).argmax(-1)
    return net, x, y, xs


@functools.lru_cache(maxsize=2)
def classifier_case(coupling: str) -> dict:
    net, x, y, xs = trained_classifier()
    sfr32, sfr64, d32, d64, rank32, numerical = pair(net, x, y, xs, "softmax", 3, num_inducing=40,
                                                     output_coupling=coupling)
    case = error_model(net, x, y, xs, sfr32, sfr64, coupling=coupling)
    case.update(sfr32=sfr32, sfr64=sfr64, rank32=rank32, numerical=numerical, d32=d32)
    return case


@pytest.mark.parametrize("coupling", ["joint", "independent"])
def test_float32_classifier_equals_its_float64_copy(coupling):
    """Means, variances, probabilities and evidence within the bounds of the error model (float32_bounds.py:
    float32 features of the data and test points, their outputs and sites, rounded by rε; propagated through the
    float64 systems, whose condition λ_max(S) is measured there), which are below 1 % of the values, so that a 1 %
    error fails (test_a_one_percent_error_fails_the_float32_checks)."""
    case = classifier_case(coupling)
    sfr32, sfr64, rank32 = case["sfr32"], case["sfr64"], case["rank32"]
    assert not case["numerical"]
    assert sfr32.dual_statistics.precision.dtype == torch.float64 and sfr32._zz_grams.dtype == torch.float64
    assert case["d32"].mean.dtype == torch.float32 and case["d32"].covariance_matrix.dtype == torch.float32
    assert torch.equal(rank32, sfr64.inducing_rank) and int(rank32.min()) == (120 if coupling == "joint" else 40)
    found = ratios(case)
    assert max(found[k] for k in ("mean", "variance", "probs", "evidence")) <= 1, found
    assert found["decisions"]  # equal decisions outside near-ties of the bound: equal accuracy on any labels
    assert case["relative"]["mean"] < 1e-2 and case["relative"]["variance"] < 1e-2, case["relative"]


@pytest.mark.parametrize("coupling", ["joint", "independent"])
def test_a_one_percent_error_fails_the_float32_checks(coupling):
    """The checks above are not vacuous: the float32 model's means, variances (and with them the probabilities) or
    evidence moved by 1 % of their value fail them."""
    case = classifier_case(coupling)
    bumped = ratios(case, mean=case["mean"] * 1.01, variance=case["variance"] * 1.01,
                    evidence=case["evidence"][0] + 1e-2 * abs(case["evidence"][1]))
    assert all(bumped[k] > 1 for k in ("mean", "variance", "probs", "evidence")), bumped
    assert ratios(case, mean=case["mean"] * 1.01)["mean"] > 1 and ratios(case, variance=case["variance"] * 1.01)[
        "variance"] > 1


def test_float32_small_cnn_equals_its_float64_copy():
    net = small_cnn(3, dtype=torch.float32, seed=0)  # Conv2d, BatchNorm (eval), ReLU, pooling, Linear
    torch.manual_seed(2)
    x, xs = torch.randn(80, 1, 6, 6), torch.randn(30, 1, 6, 6)
    with torch.no_grad():
        y = net(x).argmax(-1)
    sfr32, sfr64, d32, d64, rank32, numerical = pair(net, x, y, xs, "softmax", 3, num_inducing=20)
    assert not numerical
    assert torch.equal(rank32, sfr64.inducing_rank) and int(rank32.min()) == 60
    case = error_model(net, x, y, xs, sfr32, sfr64)  # the bounds of float32_bounds.py, as above
    found = ratios(case)
    assert max(found[k] for k in ("mean", "variance", "probs", "evidence")) <= 1 and found["decisions"], found
    assert case["relative"]["mean"] < 1e-2 and case["relative"]["variance"] < 1e-2, case["relative"]


@pytest.mark.parametrize("prior_mean", ["zero", "linearized"])
def test_float32_small_cnn_with_independent_outputs_keeps_the_float64_rank(prior_mean):
    """The public code's settings (independent outputs, one δ) on a CNN trained for a few steps only (a poorly trained
    point, where the NTK Gram has its fastest-decaying spectrum): the float32 model keeps every direction the float64
    copy keeps, with the same predictive within the bounds of the error model (float32_bounds.py)."""
    torch.manual_seed(4)
    x, xs = torch.randn(120, 1, 8, 8), torch.randn(40, 1, 8, 8)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(6 * 4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4),
    )
    y = (x.flatten(1)[:, :4].argmax(-1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(5):  # barely trained
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    net.eval()
    sfr32, sfr64, d32, d64, rank32, numerical = pair(net, x, y, xs, "softmax", 4, num_inducing=48,
                                                     output_coupling="independent", prior_mean=prior_mean,
                                                     prior_structure="network", prior_precision=2.0)
    assert not numerical
    assert torch.equal(rank32, sfr64.inducing_rank) and int(sfr64.inducing_rank.min()) == 48
    case = error_model(net, x, y, xs, sfr32, sfr64, coupling="independent", prior_mean=prior_mean, delta=2.0)
    found = ratios(case)
    assert max(found[k] for k in ("mean", "variance", "probs")) <= 1, found
    assert case["relative"]["mean"] < 1e-2 and case["relative"]["variance"] < 1e-2, case["relative"]


def regression_problem(seed=3):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x, xs = torch.randn(40, 2), torch.randn(30, 2)
    return net, x, torch.sin(2 * x.sum(-1)), xs


def mean_error_bound(numerical) -> float | None:
    """The bound (in posterior standard deviations) stated by the mean-precision warning, if one was raised."""
    for w in numerical:
        found = re.search(r"may be off by up to about ([0-9.e+-]+) posterior", str(w.message))
        if found:
            return float(found.group(1))
    return None


def variance_error_bound(numerical) -> float | None:
    """The bound (relative to the variance) stated by the variance-precision warning, if one was raised."""
    for w in numerical:
        found = re.search(r"variances may be off by up to about ([0-9.e+-]+) of their value", str(w.message))
        if found:
            return float(found.group(1))
    return None


def check_variances(d32, d64, numerical):
    """float32 variances within VARIANCE_ERROR_LIMIT (relative, at every point) of the float64 copy's, or a
    NumericalWarning states a bound on their relative error, and it holds."""
    error = ((d32.variance.double() - d64.variance).abs() / d64.variance).max().item()
    bound = variance_error_bound(numerical)
    assert error <= (VARIANCE_ERROR_LIMIT if bound is None else bound), (error, bound)
    return bound


@pytest.mark.parametrize("noise", [0.1, 1e-2, 1e-3])
def test_float32_regression_with_a_small_noise_keeps_every_direction_float64_keeps(noise):
    """The sums in float64 (ε·tr B_u grows like 1/σ²) and K_ZZ from float64 features: with σ² down to 1e-3 the float32
    model keeps all 20 inducing directions, as float64 does (float32 sums kept 2 to 6 of them). Its mean is within a
    fraction of a posterior standard deviation of float64's (σ² ≥ 1e-2), and within one or a NumericalWarning bounds
    how far off it may be, and the bound holds; the same for its variances (relative to their value)."""
    net, x, y, xs = regression_problem()
    sfr32, sfr64, d32, d64, rank32, numerical = pair(net, x, y, xs, "gaussian", 1, noise=noise, num_inducing=20)
    assert int(sfr64.inducing_rank) == 20 and int(rank32) == 20
    error = ((d32.mean.double() - d64.mean).abs() / d64.variance.sqrt()).max().item()
    bound = mean_error_bound(numerical)
    if noise >= 1e-2:
        assert bound is None and error < 0.2
    # within a posterior standard deviation (the warning's threshold), or a warning states a bound that holds
    assert error <= (1.0 if bound is None else bound), (error, bound)
    variance_bound = check_variances(d32, d64, numerical)
    if noise == 0.1:
        assert not numerical and variance_bound is None  # well conditioned: accurate and silent


def test_float32_variances_with_near_duplicate_inputs_are_accurate_or_warn():
    """The audit's case (issue 38): near-duplicate training and test inputs with σ² = 1e-3, where the posterior
    variance is far below the prior's, K_xx − VᵀV cancels the float32 rounding of K_xZ and K_xx (3.5 to 7 % off
    the float64 copy's over six draws, with the same inducing rank, and no warning before): within 1 % of the
    float64 copy's at every test point, or a NumericalWarning states a bound on the relative error that holds at
    every test point, and names the remedy."""
    net, x, y, xs = regression_problem()
    g = torch.Generator().manual_seed(5)
    x = torch.cat([x, x + 1e-4 * torch.randn(x.shape, generator=g)])
    xs = torch.cat([xs, x[:10] + 1e-4 * torch.randn(10, 2, generator=g)])
    sfr32, sfr64, d32, d64, rank32, numerical = pair(net, x, torch.sin(2 * x.sum(-1)), xs, "gaussian", 1,
                                                     noise=1e-3, num_inducing=20)
    if check_variances(d32, d64, numerical) is not None:
        assert any("variances" in str(w.message) and "net.double()" in str(w.message) for w in numerical)


def trained_tanh():
    """The reliability audit's case (issue 25, item 1): a trained 1-16-1 tanh MLP, N = 100."""
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 100)[:, None]
    y = torch.sin(3 * x[:, 0]) + 0.05 * torch.randn(100)
    net = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(1000):
        optimizer.zero_grad()
        (net(x)[:, 0] - y).square().mean().backward()
        optimizer.step()
    return net, x, y, torch.linspace(-1.2, 1.2, 50)[:, None]


@pytest.mark.slow
def test_the_float32_mean_at_the_noise_floor_is_right_or_says_how_far_it_can_be():
    """At GaussianLikelihood's floor (σ² = 1e-4) NTKGP's float32 mean was off by 0.69 (180 posterior standard
    deviations). SFR's mean, the network plus a correction formed in float64, is within a posterior standard deviation
    of the float64 copy's, or a NumericalWarning states a bound on its error (in posterior standard deviations) that
    holds."""
    net, x, y, xs = trained_tanh()
    for m in (100, 30):
        sfr32, sfr64, d32, d64, rank32, numerical = pair(net, x, y, xs, "gaussian", 1, noise=1e-4, num_inducing=m)
        assert torch.equal(rank32, sfr64.inducing_rank)
        error = ((d32.mean.double() - d64.mean).abs() / d64.variance.sqrt()).max().item()
        bound = mean_error_bound(numerical)
        assert error <= (1.0 if bound is None else bound), "a mean this far off must warn, with a bound that holds"
        check_variances(d32, d64, numerical)  # within VARIANCE_ERROR_LIMIT, or within the bound a warning states


def test_directions_k_zz_resolves_are_kept_by_the_float32_model():
    """Two nearly equal inducing inputs: K_ZZ (formed in float64) resolves their difference, and so do the float32
    model's cross-covariances, float64 products of its float32 features with the float64 features of Z (their
    rounding moves V = W K_Zx by no more than the features' own, whatever K_ZZ's condition): the float32 model keeps
    all 11 directions, as the float64 copy does, with means and variances within the bounds of the error model
    (float32_bounds.py). (Float32 products rounded K_Zx by ε‖K‖, amplified by √(tr K_ZZ / s): that direction was
    dropped and the predictive moved by 7 % and 15 %.)"""
    net, x, y, xs = regression_problem()
    z = torch.cat([x[:10], x[:1] + 1e-3])
    sfr32, sfr64, d32, d64, rank32, numerical = pair(net, x, y, xs, "gaussian", 1, inducing_points=z)
    assert int(sfr64.inducing_rank) == 11 and int(rank32) == 11
    assert not any("inducing directions" in str(w.message) for w in numerical)
    case = error_model(net, x, y, xs, sfr32, sfr64, kind="gaussian", noise=0.1)
    found = ratios(case)
    assert max(found.values()) <= 1, found
    assert case["relative"]["mean"] < 1e-2 and case["relative"]["variance"] < 1e-2, case["relative"]


def test_float32_statistics_with_a_small_noise_still_warn():
    """Converting the model's statistics to float32 (sfr.float()) brings back float32 sums: with σ² = 1e-3 their
    rounding hides most directions, and a NumericalWarning says so (the float32 default keeps all 20)."""
    net, x, y, xs = regression_problem()
    lik = GaussianLikelihood()
    lik.noise = 1e-3
    sfr = SFR(net, x, y, lik, num_inducing=20)
    assert int(sfr.inducing_rank) == 20
    sfr.float()
    with pytest.warns(NumericalWarning, match="rounding of the summed site statistics"):
        rank = int(sfr.inducing_rank.min())
    assert rank < 10


def test_double_on_a_float32_network_keeps_float32_thresholds():
    """sfr.double() converts the model's buffers, not the network: the features are still the float32 network's
    (contracted in float64, as before the conversion), so the float64 model is the float32 one without its final
    rounding to float32."""
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, xs = torch.randn(30, 2), torch.randn(5, 2)
    lik = GaussianLikelihood()
    lik.noise = 0.1
    sfr = SFR(net, x, torch.sin(x.sum(-1)), lik, num_inducing=10)
    with torch.no_grad():
        single = sfr(xs)
        mean32, var32 = single.mean.double(), single.variance.double()
        sfr.double()
        dist = sfr(xs.double())
        assert dist.mean.dtype == torch.float64 and (dist.variance > 0).all()
        # the same float64 computation on the same float32 features, but for the float32 model's last rounding
        # (≤ 2⁻²⁴ relatively per entry, so below ε₃₂ normwise) and float64 rounding (far below)
        assert rel_err(dist.mean, mean32) < EPS32 and rel_err(dist.variance, var32) < EPS32


class _Uncopyable(torch.nn.Module):
    """A network holding a lock, which copy.deepcopy refuses."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.body = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.lock = threading.Lock()

    def forward(self, x):
        return self.body(x)


def test_a_network_that_cannot_be_copied_forms_k_zz_in_float32_and_says_so():
    torch.manual_seed(0)
    net = _Uncopyable()
    x, xs = torch.randn(30, 2), torch.randn(10, 2)
    with pytest.raises(TypeError):
        copy.deepcopy(net)
    lik = GaussianLikelihood()
    lik.noise = 0.1
    with pytest.warns(NumericalWarning, match="could not copy the network"):
        sfr = SFR(net, x, torch.sin(x.sum(-1)), lik, num_inducing=10)
    assert sfr._zz_grams.dtype == torch.float64 and sfr._zz_precision == torch.float32
    reference = SFR(net.body, x, torch.sin(x.sum(-1)), lik, inducing_points=sfr.inducing_points)  # copyable
    assert int(sfr.inducing_rank) <= int(reference.inducing_rank)
    dist = sfr(xs)
    assert torch.isfinite(dist.mean).all() and (dist.variance > 0).all()
