"""The one-node evidence (ntkgp.laplace.spectral_evidence) on the diagonal spectra of KFAC and the diagonal, for every layout
of the groups (one group, which broadcasts; consecutive runs; groups out of order; interleaved), value and first
derivatives against the formula written in plain torch and differentiated by autograd."""

import math

import pytest
import torch

from ntkgp.laplace.spectral_evidence import Spectrum, spectral_evidence


def node(delta, variance, u, groups, power, norms, stats):
    """The node on the arguments of :func:`reference`."""
    return spectral_evidence(delta, variance, Spectrum(u, groups, power, norms), tuple(stats[:, 0].tolist()))


def reference(delta, variance, u, groups, power, norms, stats):
    """The evidence as the difference of the two log-determinants, in plain torch; ``variance`` is 1/s."""
    sizes = torch.bincount(groups, minlength=delta.shape[0]).to(delta)
    s = 1 / variance.reshape(()) if torch.is_tensor(variance) else torch.tensor(1.0 / variance, dtype=delta.dtype)
    alpha, beta, gamma = stats[:, 0]
    terms = s**power * u + delta[groups]
    return (alpha + beta * s.log() + gamma * s - (delta * norms).sum() / 2 + (sizes * delta.log()).sum() / 2
            - terms.log().sum() / 2)


def _sum_bound(eps, summands, roundings):
    """ε[(N + k)Σ|t_i| + kN] for a sum of N summands t_i, each computed with k roundings (absolute error
    kε(1 + |t_i|): the ``1`` for a logarithm, whose argument's relative error becomes an absolute one) and summed in
    any order (recursive summation: (N − 1)ε Σ|t_i| in the worst case)."""
    n, total = sum(t.numel() for t in summands), sum(t.abs().sum() for t in summands)
    return eps * ((n + roundings) * total + roundings * n)


def rounding_bounds(delta, variance, u, groups, power, norms, stats, eps):
    """Bounds on |node − reference| for the value and the gradients: the inputs are the same (rounded to the dtype
    first), so only the evaluation roundings count, a worst case over their directions (any CPU, any thread count).
    The node (dtype, ε = ``eps``) sums α, β log s, γ s, −½δ_g‖θ_g‖² and −½ log1p(z_p), z_p = s^q u_p / δ_g(p), and
    differentiates to −½‖θ_g‖² + ½Σ_{p∈g} z_p/(δ_g(1 + z_p)) and −βs − γs² + ½Σ_p q s z_p/(1 + z_p); the
    reference (float64, ε64) sums the log-determinants' terms ½P_g log δ_g and −½ log(s^q u_p + δ_g(p)) and
    their derivatives ½P_g/δ_g and −½/(s^q u_p + δ_g(p)). Each summand takes at most q + 6 roundings (s, s^q, the
    products, the quotient, the logarithm, the halving); the float64 reference rounded to the dtype adds ε|value|.
    All magnitudes are measured here in float64."""
    d, v, u, norms = (t.detach().double() for t in (delta, variance, u, norms))
    alpha, beta, gamma = stats.double()[:, 0]
    s = 1 / v.reshape(())
    sizes = torch.bincount(groups, minlength=d.shape[0]).double()
    k, e64 = power + 6, torch.finfo(torch.float64).eps
    terms = s**power * u + d[groups]
    z = s**power * u / d[groups]
    data = [alpha.reshape(1), (beta * s.log()).reshape(1), (gamma * s).reshape(1), -d * norms / 2]
    value = (alpha + beta * s.log() + gamma * s - (d * norms).sum() / 2 - torch.log1p(z).sum() / 2).abs()
    bound_value = (_sum_bound(eps, data + [-torch.log1p(z) / 2], k)
                   + _sum_bound(e64, data + [sizes * d.log() / 2, -terms.log() / 2], k) + eps * value)
    bound_delta = []
    for g in range(d.shape[0]):
        inside = groups == g
        node = [-norms[g:g + 1] / 2, z[inside] / (2 * d[g] * (1 + z[inside]))]
        ref = [-norms[g:g + 1] / 2, (sizes[g] / (2 * d[g])).reshape(1), -1 / (2 * terms[inside])]
        grad = (-norms[g] / 2 + (z[inside] / (2 * d[g] * (1 + z[inside]))).sum()).abs()
        bound_delta.append(_sum_bound(eps, node, k) + _sum_bound(e64, ref, k) + eps * grad)
    outer = [(-beta * s).reshape(1), (-gamma * s**2).reshape(1)]
    grad_s = (-beta * s - gamma * s**2 + (power * s * z / (2 * (1 + z))).sum()).abs()
    bound_variance = (_sum_bound(eps, outer + [power * s * z / (2 * (1 + z))], k)
                      + _sum_bound(e64, outer + [power * s**(power + 1) * u / (2 * terms)], k) + eps * grad_s)
    return {"value": bound_value, "delta": torch.stack(bound_delta), "variance": bound_variance}


LAYOUTS = {
    "one group": [40],
    "consecutive runs": [7, 20, 13],
    "out of order": [7, 20, 13],  # group ids permuted: 2, 0, 1
    "interleaved": [5, 5, 5, 5],  # groups 0, 1, 0, 1
    "many groups": [3] * 12,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("power", [1, 2])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_value_and_gradients_against_autograd(name, power, dtype):
    g = torch.Generator().manual_seed(0)
    lengths = LAYOUTS[name]
    ids = {"out of order": [2, 0, 1], "interleaved": [0, 1, 0, 1]}.get(name, list(range(len(lengths))))
    groups = torch.repeat_interleave(torch.tensor(ids), torch.tensor(lengths))
    num_groups = max(ids) + 1
    p = groups.shape[0]
    u = torch.rand(p, generator=g, dtype=torch.float64).to(dtype) * 3
    u[::4] = 0  # eigenvalues at zero: the prior alone
    norms = torch.rand(num_groups, generator=g, dtype=torch.float64).to(dtype)
    sizes = torch.bincount(groups, minlength=num_groups).to(dtype)
    stats = torch.tensor([[-1.3], [50.0], [-7.5]], dtype=dtype)
    delta0 = torch.rand(num_groups, generator=g, dtype=torch.float64).to(dtype) + 0.2
    variance0 = torch.tensor([0.7], dtype=dtype)
    values, grads = [], []
    for fn, dt in ((node, dtype), (reference, torch.float64)):  # the formula at the same inputs in
        delta, variance = delta0.to(dt).requires_grad_(), variance0.to(dt).requires_grad_()  # float64, rounded
        value = fn(delta, variance, u.to(dt), groups, power, norms.to(dt), stats.to(dt))  # to dtype
        values.append(value.detach().to(dtype))
        grads.append([g.to(dtype) for g in torch.autograd.grad(value, [delta, variance])])
    (value, expected), ((gd, gs), (ed, es)) = values, grads
    assert value.dtype == dtype
    bounds = rounding_bounds(delta0, variance0, u, groups, power, norms, stats, torch.finfo(dtype).eps)
    assert (value.double() - expected.double()).abs() <= bounds["value"]
    assert ((gd.double() - ed.double()).abs() <= bounds["delta"]).all()
    assert ((gs.double() - es.double()).abs() <= bounds["variance"]).all()
    # tight enough that a real bug of 1e-2 relative fails
    assert bounds["value"] < 1e-2 * expected.double().abs()
    assert (bounds["delta"] < 1e-2 * ed.double().abs()).all() and (bounds["variance"] < 1e-2 * es.double().abs()).all()


@pytest.mark.parametrize("wanted", ["delta", "variance", "neither"])
@pytest.mark.parametrize("num_groups", [1, 3])
def test_only_the_asked_derivative_scaled_by_the_incoming_gradient_against_autograd(wanted, num_groups):
    """The derivatives are formed in the forward pass only for the inputs that need them; the backward pass scales
    them by the incoming gradient (here 2.5 times a downstream function's)."""
    g = torch.Generator().manual_seed(1)
    groups = torch.arange(num_groups).repeat_interleave(6)
    u = torch.rand(groups.shape[0], generator=g, dtype=torch.float64) * 2
    norms = torch.rand(num_groups, generator=g, dtype=torch.float64)
    stats = torch.tensor([[-0.4], [12.0], [-3.0]], dtype=torch.float64)
    results = []
    for fn in (node, reference):  # the gradient in the shape of its input
        delta = (torch.rand(num_groups, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
                 ).requires_grad_(wanted == "delta")
        variance = torch.tensor(1.7, dtype=torch.float64, requires_grad=wanted == "variance")  # shape (): T
        value = fn(delta, variance, u, groups, 2, norms, stats)
        if wanted == "neither":
            assert not value.requires_grad
            results.append(value)
            continue
        leaf = delta if wanted == "delta" else variance
        results.append(torch.autograd.grad(torch.sin(value) * 2.5, leaf)[0])
    assert torch.allclose(results[0], results[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("delta", [1e2, 1e4, 1e6])
def test_float32_value_and_gradient_lose_no_digits_to_a_large_prior_precision(delta):
    """With δ much larger than the curvature, log|H + P0| − log|P0| = Σ log1p(s u / δ) is small beside either
    log-determinant: the float32 evidence and its gradient, against the formula in float64 at the same inputs, keep
    float32's digits (the difference of the two log-determinants in float32 was off by 6e-5 at δ = 1e4)."""
    g = torch.Generator().manual_seed(3)
    p = 5000
    u = torch.rand(p, generator=g, dtype=torch.float64).float().double()
    groups = torch.zeros(p, dtype=torch.long)
    norms = torch.tensor([1e-3], dtype=torch.float64)
    stats = torch.tensor([[0.0], [0.0], [-1.0]], dtype=torch.float64)
    results = []
    for fn, dt in ((node, torch.float32), (reference, torch.float64)):
        d = torch.tensor([delta], dtype=dt, requires_grad=True)
        value = fn(d, torch.ones(1, dtype=dt), u.to(dt), groups, 1, norms.to(dt), stats.to(dt))
        results.append((value.item(), torch.autograd.grad(value, d)[0].item()))
    (value, grad), (expected, expected_grad) = results
    # Error model (ε = ε32): with one group the node's scalars are Python floats (float64) and only z_p = u_p·(s/δ)
    # (2 roundings: s/δ cast, the product), log1p(z_p) (1 more; z's relative error moves it by ≤ 2ε z/(1 + z)
    # ≤ 2ε log1p z), z/(1 + z) (2 more) and their sums of P positive terms are float32. A blocked sum (log2 P
    # roundings, the convention of tests.helpers.float32_roundings, plus up to 16 sequential additions in one
    # accumulator before blocks combine) adds 16 + log2 P per term: with c = 5 + 16 + log2 P, L = Σ log1p z, S = Σ z/(1 + z):
    # |Δvalue| ≤ ε(½cL + ½δ‖θ‖² + |value|) (‖θ‖² rounded to float32; the float32 result), |Δgrad| ≤ ε(½cS/δ + ½‖θ‖²
    # + |grad|). At most 35ε32 (4e-6) relative here (2ε32 at δ = 1e6): the 6e-5 of the difference of log-determinants
    # at δ = 1e4, or any 100ε32 error, fails.
    z = u / delta
    c = 5 + 16 + math.log2(p)
    eps, theta_sq = torch.finfo(torch.float32).eps, norms.item()
    assert abs(value - expected) <= eps * (0.5 * c * torch.log1p(z).sum().item() + 0.5 * delta * theta_sq
                                            + abs(expected))
    assert abs(grad - expected_grad) <= eps * (0.5 * c * (z / (1 + z)).sum().item() / delta + 0.5 * theta_sq
                                                + abs(expected_grad))


@pytest.mark.parametrize("variance", [None, 0.3, 2.5])
@pytest.mark.parametrize("num_groups", [1, 3])
def test_a_fixed_variance_as_a_number_against_autograd(variance, num_groups):
    """A temperature that is not learned comes as a number (or ``None``: s = 1); the value and the δ-gradient
    against the formula with the same variance as a tensor without a graph."""
    g = torch.Generator().manual_seed(4)
    groups = torch.arange(num_groups).repeat_interleave(9)
    u = torch.rand(groups.shape[0], generator=g, dtype=torch.float64) * 2
    norms = torch.rand(num_groups, generator=g, dtype=torch.float64)
    stats = torch.tensor([[0.0], [0.0], [-21.0]], dtype=torch.float64)
    results = []
    for fn, v in ((node, variance), (reference, 1.0 if variance is None else torch.tensor(variance, dtype=torch.float64))):
        delta = (torch.rand(num_groups, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
                 ).requires_grad_()
        value = fn(delta, v, u, groups, 1, norms, stats)
        results.append((value.detach(), torch.autograd.grad(value, delta)[0]))
    (value, grad), (expected, expected_grad) = results
    assert torch.allclose(value, expected, rtol=1e-12, atol=0)
    assert torch.allclose(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("structure", ["diag_ggn", "kfac"])
@pytest.mark.parametrize("groups", ["network", "layer"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_curvature_evidence_rejects_a_bad_prior_precision_tensor(bad, groups, structure):
    """A (G,) tensor of the curvature's dtype with a non-positive or non-finite entry: ValueError naming
    prior_precision (with one group the node checks the one number it reads), nothing computed."""
    from ntkgp.laplace.weight_space import compute_curvature
    from ntkgp.likelihoods import SoftmaxLikelihood

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 3, (12,))
    likelihood = SoftmaxLikelihood(3).double()
    curvature = compute_curvature(net, x, y, likelihood, structure, prior_structure=groups)
    delta = torch.ones(curvature.groups.num_groups, dtype=torch.float64)
    delta[-1] = bad
    with pytest.raises(ValueError, match="prior_precision"):
        curvature.log_marginal_likelihood(delta.requires_grad_(), likelihood)
