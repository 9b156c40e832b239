"""A distribution never goes stale (docs/guarantees.md, "Distributions are snapshots"): ``dist = model(x)`` of NTKGP
(function and weight space), SFR and FSVI, then a change of δ, of the Gaussian noise σ², of a tempered softmax's T,
of the network's weights (a ``.data`` write, an optimizer step) or one optimizer step of the model's evidence (ELBO
for FSVI), then ``dist.mean``, ``.variance``, ``.covariance_matrix`` and a product: those of a model built fresh, on a
copy of the network, at the old values (read before the change, so no part of it can see the change)."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.fsvi import FSVI, FunctionSpaceELBO
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from tests.helpers import (
    EPS32,
    brute_jacobian,
    column_groups,
    float32_precision_error,
    float32_roundings,
    mlp,
)

DELTA = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
# float64 throughout: the distribution and the fresh model form the same products on the same values, agreeing to
# rounding (ε64 times the condition numbers of these small, well-conditioned problems); a stale read is O(0.1-1) off
TOL = dict(rtol=1e-8, atol=1e-10)


def _problem(kind: str):
    """A small trained-looking network, its data, test inputs and a likelihood (Gaussian or tempered softmax)."""
    c = 1 if kind == "gaussian" else 3
    net = mlp(d_in=3, width=6, d_out=c, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(14, 3, generator=gen, dtype=torch.float64)
    xt = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    if kind == "gaussian":
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        likelihood.noise = 0.05
        y = torch.sin(x.sum(-1))
    else:
        likelihood = SoftmaxLikelihood(3, temperature=0.7, learn_temperature=True).double()
        y = torch.randint(0, 3, (14,), generator=gen)
    return net, x, y, xt, likelihood


def _read(dist) -> dict[str, torch.Tensor]:
    cov = dist.lazy_covariance_matrix
    v = torch.linspace(-1, 1, cov.shape[-1], dtype=torch.float64).unsqueeze(-1)
    return {
        "mean": dist.mean.detach(),
        "variance": dist.variance.detach(),
        "covariance": dist.covariance_matrix.detach(),
        "product": (cov @ v).detach(),
    }


def _assert_reads(dist, reference: dict[str, torch.Tensor]) -> None:
    for name, value in _read(dist).items():
        torch.testing.assert_close(value, reference[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------- the changes
def _delta(model, net, likelihood, data):
    kernel = model.covar_module
    kernel.prior_precision = kernel.prior_precision.detach() * 4


def _noise(model, net, likelihood, data):
    likelihood.noise = likelihood.noise.detach() * 6


def _temperature(model, net, likelihood, data):
    likelihood.temperature = 2.0


def _data(model, net, likelihood, data):
    net[0].weight.data.mul_(1.5)


def _step(model, net, likelihood, data):
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    net(data[0]).square().sum().backward()
    opt.step()


def _evidence_step(model, net, likelihood, data):
    """One Adam step of the evidence over the model's hyperparameters (GPyTorch's loop for an ExactGP)."""
    x, y = data
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    if isinstance(model, gpytorch.models.ExactGP):
        loss = -gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)(model(x), y)
    else:
        loss = -model.log_marginal_likelihood()
    loss.backward()
    opt.step()
    model.eval()


CHANGES = {"delta": _delta, "noise": _noise, "temperature": _temperature, "data": _data, "step": _step,
           "evidence_step": _evidence_step}
GAUSSIAN_ONLY, SOFTMAX_ONLY = {"noise"}, {"temperature"}


def _cases():
    for change in CHANGES:
        for kind in ("gaussian", "softmax"):
            if (change in GAUSSIAN_ONLY and kind != "gaussian") or (change in SOFTMAX_ONLY and kind != "softmax"):
                continue
            yield change, kind


# ---------------------------------------------------------------------- NTKGP
def _ntkgp(net, x, y, likelihood, space):
    return ntkgp.NTKGP(net, x, y, likelihood, prior_precision=DELTA, space=space).eval()


@pytest.mark.parametrize("space", ["function", "weight"])
@pytest.mark.parametrize(("change", "kind"), list(_cases()))
def test_ntkgp_distribution_is_the_model_of_its_moment(space, change, kind):
    net, x, y, xt, likelihood = _problem(kind)
    fresh = _ntkgp(copy.deepcopy(net), x, y, copy.deepcopy(likelihood), space)
    reference = _read(fresh(xt))
    model = _ntkgp(net, x, y, likelihood, space)
    dist = model(xt)
    CHANGES[change](model, net, likelihood, (x, y))
    now = _read(model(xt))["variance"]
    assert (now - reference["variance"]).abs().max() > 1e-3  # the change matters: a stale read would differ
    _assert_reads(dist, reference)


def test_ntkgp_observation_noise_and_output_indices_are_snapshots_too():
    """``observation_noise=True`` adds σ² of the call, and a selection of outputs reads the old values."""
    net, x, y, xt, likelihood = _problem("gaussian")
    fresh = _ntkgp(copy.deepcopy(net), x, y, copy.deepcopy(likelihood), "function")
    reference = _read(fresh.posterior(xt, observation_noise=True).distribution)
    model = _ntkgp(net, x, y, likelihood, "function")
    dist = model.posterior(xt, observation_noise=True).distribution
    _noise(model, net, likelihood, None)
    _delta(model, net, likelihood, None)
    _data(model, net, likelihood, None)
    _assert_reads(dist, reference)


# ---------------------------------------------------------------------- SFR
def _sfr(net, x, y, likelihood):
    return SFR(net, x, y, likelihood, num_inducing=6, prior_precision=DELTA)


@pytest.mark.parametrize(("change", "kind"), list(_cases()))
def test_sfr_distribution_is_the_model_of_its_moment(change, kind):
    net, x, y, xt, likelihood = _problem(kind)
    reference = _read(_sfr(copy.deepcopy(net), x, y, copy.deepcopy(likelihood))(xt))
    model = _sfr(net, x, y, likelihood)
    dist = model(xt)
    CHANGES[change](model, net, likelihood, (x, y))
    _assert_reads(dist, reference)


def test_sfr_distribution_over_many_chunks_and_moved_inducing_inputs():
    """With more test points than a chunk the low-rank factors are recomputed at every read: at the old weights and
    inducing inputs."""
    net, x, y, xt, likelihood = _problem("gaussian")
    xt = torch.cat([xt, xt + 0.5])
    fresh = _sfr(copy.deepcopy(net), x, y, copy.deepcopy(likelihood))
    reference = _read(fresh(xt, chunk_size=3))
    model = _sfr(net, x, y, likelihood)
    dist = model(xt, chunk_size=3)
    _step(model, net, likelihood, (x, y))
    model.inducing_points.add_(0.25)
    _assert_reads(dist, reference)


# ---------------------------------------------------------------------- FSVI
def _fsvi(net, likelihood):
    model = FSVI(net, likelihood, prior_precision=DELTA, init_std=0.05)
    with torch.no_grad():  # a variational state away from its initial values
        for i, m in enumerate(model.variational_distribution.mean):
            m.add_(0.1 * torch.cos(torch.arange(m.numel(), dtype=m.dtype) + i).reshape(m.shape))
    return model


def _fsvi_mean(model, net, likelihood, data):
    model.variational_distribution.mean[0].data.mul_(1.5)


def _fsvi_std(model, net, likelihood, data):
    model.variational_distribution.raw_std[2].data.add_(1.0)


def _elbo_step(model, net, likelihood, data):
    """One Adam step of FSVI's objective over μ, s (and the likelihood's parameters)."""
    x, y = data
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    loss = -FunctionSpaceELBO(model, num_data=x.shape[0])(x, y, x[:6], torch.Generator().manual_seed(0)).value
    loss.backward()
    opt.step()


FSVI_CHANGES = {"mean": _fsvi_mean, "std": _fsvi_std, "elbo_step": _elbo_step, "data": _data, "noise": _noise,
                "temperature": _temperature}


@pytest.mark.parametrize("change", list(FSVI_CHANGES))
def test_fsvi_distribution_is_the_model_of_its_moment(change):
    kind = "softmax" if change == "temperature" else "gaussian"
    net, x, y, xt, likelihood = _problem(kind)
    model = _fsvi(net, likelihood)
    fresh = FSVI(copy.deepcopy(net), copy.deepcopy(likelihood), prior_precision=DELTA, init_std=0.05)
    fresh.load_state_dict(model.state_dict())
    reference = _read(fresh(xt))
    dist = model(xt)
    FSVI_CHANGES[change](model, net, likelihood, (x, y))
    _assert_reads(dist, reference)


def test_fsvi_conditioned_distribution_is_the_model_of_its_moment():
    """On a conditioned FSVI (exact GP posterior given observations) the prior part is a snapshot as well."""
    net, x, y, xt, likelihood = _problem("gaussian")
    model = _fsvi(net, likelihood).condition_on(x[:5], y[:5])
    fresh = _fsvi(copy.deepcopy(net), copy.deepcopy(likelihood)).condition_on(x[:5], y[:5])
    reference = _read(fresh(xt))
    dist = model(xt)
    _elbo_step(model, net, likelihood, (x, y))
    _noise(model, net, likelihood, None)
    _assert_reads(dist, reference)


def test_fsvi_distribution_refuses_a_changed_frozen_parameter():
    """FSVI's covariance reads the network's frozen parameters and buffers (fingerprinted, not copied): a change of
    one between the call and the read raises rather than mixing."""
    net, x, y, xt, likelihood = _problem("gaussian")
    net[0].bias.requires_grad_(False)
    model = _fsvi(net, likelihood)
    dist = model(xt)
    net[0].bias.data.add_(0.5)
    with pytest.raises(RuntimeError, match="frozen parameters changed"):
        dist.variance


@pytest.mark.parametrize("space", ["function", "weight"])
def test_a_float32_distribution_is_a_snapshot_too(space):
    """A float32 network: the distribution read after δ and the weights changed equals its own read before the
    change (the same float32 computation on the same values), and both are the float64 copy's within float32
    accuracy: a stale read is O(0.1) off."""
    net, x, y, xt, likelihood = _problem("gaussian")
    net32, lik32 = copy.deepcopy(net).float(), copy.deepcopy(likelihood).float()
    model = ntkgp.NTKGP(net32, x.float(), y.float(), lik32, prior_precision=DELTA.float(), space=space).eval()
    before = _read(model(xt.float()))
    dist = model(xt.float())
    _delta(model, net32, lik32, None)
    _data(model, net32, lik32, None)
    after = _read(dist)
    # the same float32 operations on the same values: a few ε32 (1.2e-7) relative to entries of order one; rtol
    # 1e-5 ≈ 80ε32 leaves room for a reordered reduction (log2 of the sizes summed, a few dozen roundings at most)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-5, atol=1e-6)
    fresh = _ntkgp(net, x, y, likelihood, space)
    reference = _read(fresh(xt))
    # float32 against float64, first order (ε = ε32, r from float32_roundings: each float32 Jacobian row within rε of
    # its norm), every quantity measured on the float64 copy. The variance is v_i = K**_ii − k_iᵀA⁻¹k_i, A = K + σ²I:
    # - function space (float32 Gram, Cholesky of A): |ΔK_ij| ≤ rε√(K_ii K_jj), so ‖Δk_i‖ ≤ rε√(K**_ii tr K),
    #   ‖ΔA‖ ≤ rε tr K + (n+1)ε‖A‖_F + εσ², and with a_i = A⁻¹k_i:
    #   |Δv_i| ≤ rεK**_ii + 2‖a_i‖‖Δk_i‖ + ‖a_i‖²‖ΔA‖;
    # - weight space (v_i = G_i J*_iᵀ, G_i = J*_i H⁻¹, H = JᵀJ/σ² + diag δ): |Δv_i| ≤ 2rε‖J*_i‖‖G_i‖ + ‖ΔH‖‖G_i‖²,
    #   ‖ΔH‖ from float32_precision_error (the Jacobian on both sides, the sum, a float32 Cholesky of size P).
    # A worst case over the roundings' directions: it holds on any CPU and thread count; it is asserted below 1e-2
    # of the variance, so a stale read (O(0.1) off) or a 1e-2 bug still fails.
    noise = likelihood.noise.item()
    j, names = brute_jacobian(net, x)
    j_test, _ = brute_jacobian(net, xt)
    r, eps = float32_roundings(net), EPS32
    with torch.no_grad():
        if space == "function":
            gram = fresh.covar_module(x).to_dense()
            cross = fresh.covar_module(xt, x).to_dense()
            prior = fresh.covar_module(xt, diag=True)
            a = gram + noise * torch.eye(gram.shape[0], dtype=torch.float64)
            gains = torch.linalg.solve(a, cross.T).T  # a_i = A⁻¹k_i, one row per test point
            trace = torch.diagonal(gram).sum()
            d_a = r * eps * trace + (gram.shape[0] + 1) * eps * torch.linalg.matrix_norm(a) + eps * noise
            d_k = r * eps * (prior * trace).sqrt()
            bound = r * eps * prior + 2 * gains.norm(dim=-1) * d_k + gains.norm(dim=-1).square() * d_a
        else:
            groups = column_groups(net, {n: i // 2 for i, n in enumerate(names)})  # weight and bias of a layer
            delta_cols = DELTA[groups]
            h = j.T @ j / noise + torch.diag(delta_cols)
            gains = torch.linalg.solve(h, j_test.T).T  # G_i = J*_i H⁻¹
            d_h = float32_precision_error(net, x, 1 / noise, gaussian=True, factorized=h.shape[0],
                                          delta=DELTA.max().item())["precision"]
            bound = 2 * r * eps * j_test.norm(dim=-1) * gains.norm(dim=-1) + d_h * gains.norm(dim=-1).square()
    assert bool((bound < 1e-2 * reference["variance"]).all())
    assert bool(((after["variance"].double() - reference["variance"]).abs() <= bound).all())
