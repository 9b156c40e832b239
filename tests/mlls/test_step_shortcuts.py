"""The shortcuts of a one-δ hyperparameter step (issue 26), each against an independent computation: the one walk of
the network's modules against torch's own walks, the MLL's priors against their log densities written out, the NTK's
lazy tensor and its size against GPyTorch's generic ones, the train-mode call against ExactGP's rules, and the step
after structural changes of the network (a new parameter tensor, a new layer) against the Cholesky route."""

import copy
import math

import gpytorch
import pytest
import torch
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.priors import GammaPrior, NormalPrior
from torch import nn

import ntkgp
from ntkgp.kernels.lazy import NTKLazyKernelTensor
from ntkgp.ntk.network import walk
from tests.helpers import EPS32, brute_jacobian, float32_precision_error, rel_err


def _problem(n=25, d_out=1, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, d_out)).double().eval()
    x = torch.randn(n, 2, dtype=torch.float64)
    y = torch.sin(2 * x[:, 0])
    return net, x, y


def test_the_walk_gives_what_torchs_three_walks_give():
    shared = nn.Linear(3, 3)
    net = nn.Sequential(shared, nn.Tanh(), nn.Sequential(shared, nn.BatchNorm1d(3)), nn.Linear(3, 2, bias=False))
    net[2][1].register_buffer("extra", torch.ones(2), persistent=False)
    net.register_buffer("alias", net[2][1].running_mean)  # one buffer under two names
    net[0].bias2 = nn.Parameter(torch.zeros(3))
    net[0].weight2 = net[3].weight  # one parameter under two names
    net[0].register_parameter("absent", None)
    walked = walk(net)
    assert walked.modules == list(net.named_modules())
    assert list(walked.parameters) == [name for name, _ in net.named_parameters()]
    assert all(a is b for a, b in zip(walked.parameters.values(), net.parameters()))
    buffers = list(net.buffers())
    assert len(walked.buffers) == len(buffers) and all(a is b for a, b in zip(walked.buffers, buffers))


def test_every_registered_prior_is_added_once_even_one_registered_after_the_mll():
    net, x, y = _problem()
    noise_prior = GammaPrior(torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64))
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_prior=noise_prior).double()
    lik.noise = 0.2
    delta_prior = GammaPrior(torch.tensor(3.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64))
    kernel_kwargs = {"prior_precision_prior": delta_prior}
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.5, prior_structure="network", **kernel_kwargs).train()
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    evidence = model.log_marginal_likelihood().detach()
    delta = model.covar_module.prior_precision.detach()  # 1.5 through the constraint's transform and back
    expected = evidence + noise_prior.log_prob(lik.noise.detach()).sum() + delta_prior.log_prob(delta).sum()
    assert rel_err(mll(model(x), y).detach() * x.shape[0], expected) < 1e-12
    # a prior registered on the model itself after the MLL was built: counted at the next call
    model.register_prior("scale_prior", NormalPrior(torch.tensor(0.0, dtype=torch.float64),
                                                    torch.tensor(2.0, dtype=torch.float64)),
                         lambda m: m.covar_module.prior_precision.log())
    two = torch.tensor(2.0, dtype=torch.float64)
    extra = torch.distributions.Normal(torch.zeros_like(two), two).log_prob(delta.log()).sum()
    assert rel_err(mll(model(x), y).detach() * x.shape[0], expected + extra) < 1e-12


@pytest.mark.parametrize("d_out", [1, 2])
def test_the_lazy_kernel_and_its_size_against_gpytorchs(d_out):
    net, x, _ = _problem(d_out=d_out)
    kernel = ntkgp.NTKKernel(net, prior_precision=2.0)
    x2 = torch.randn(7, 2, dtype=torch.float64)
    batch = torch.randn(3, 4, 2, dtype=torch.float64)
    for a, b in ((x, None), (x, x2), (batch, None), (batch, x2)):
        lazy = kernel(a, b)
        assert type(lazy) is NTKLazyKernelTensor
        generic = LazyEvaluatedKernelTensor(a, a if b is None else b, kernel=kernel)
        assert lazy.shape == generic.shape
        with gpytorch.settings.lazily_evaluate_kernels(False):
            dense = kernel(a, b).to_dense()
        assert lazy.to_dense().shape == dense.shape and torch.allclose(lazy.to_dense(), dense, rtol=1e-13, atol=0)
    batched = ntkgp.NTKKernel(net, prior_precision=torch.ones(2, 2, dtype=torch.float64), batch_shape=torch.Size([2]))
    assert batched(x).shape == LazyEvaluatedKernelTensor(x, x, kernel=batched).shape == (2, 25 * d_out, 25 * d_out)
    # active_dims goes through GPyTorch's call: the kernel on the selected columns
    wide = torch.randn(6, 3, dtype=torch.float64)
    selecting = ntkgp.NTKKernel(net, prior_precision=2.0, active_dims=torch.tensor([0, 2]))
    assert torch.allclose(selecting(wide).to_dense(), kernel(wide[:, [0, 2]]).to_dense(), rtol=1e-13, atol=0)


def test_the_train_mode_call_keeps_exactgps_rules():
    net, x, y = _problem()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.5, prior_structure="network").train()
    other = torch.randn(25, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="training inputs"):
        model(other)
    with gpytorch.settings.debug(False):  # GPyTorch's check off: the prior at the inputs given
        prior = model(other)
    reference = model.forward(other)
    assert torch.equal(prior.mean, reference.mean)
    assert torch.allclose(prior.covariance_matrix, reference.covariance_matrix, rtol=1e-13, atol=0)
    copy = model(x.clone())  # an equal copy of the training inputs is the training inputs
    assert torch.equal(copy.mean, model(x).mean)
    bad = x.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN"):
        model(bad)

    class Shifted(type(model)):
        def forward(self, x):
            out = super().forward(x)
            return type(out)(out.mean + 1.0, out.lazy_covariance_matrix)

    shifted = Shifted(net, x, y, gpytorch.likelihoods.GaussianLikelihood().double(), prior_structure="network").train()
    assert torch.allclose(shifted(x).mean, model(x).mean + 1.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("change", ["parameter", "layer"])
def test_the_step_follows_structural_changes_of_the_network(change):
    """A new parameter tensor or a new layer (with the same names and shapes) leaves the old tensors as they were:
    the walk finds the new ones, and the eigen route of the MLL equals the Cholesky route after the change."""
    net, x, y = _problem()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.5, prior_structure="network").train()
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    before = mll(model(x), y).detach()
    if change == "parameter":
        net[0].weight = nn.Parameter(net[0].weight.detach() * 1.7)
    else:
        layer = nn.Linear(5, 1).double()
        with torch.no_grad():
            layer.weight.copy_(net[2].weight * -0.5)
            layer.bias.copy_(net[2].bias + 0.3)
        net[2] = layer
    value = mll(model(x), y) * x.shape[0]
    exact = model.log_marginal_likelihood(method="cholesky")
    assert rel_err(value.detach(), exact.detach()) < 1e-10
    assert rel_err(before * x.shape[0], exact.detach()) > 1e-3  # the change is one the evidence sees


def _float32_evidence_error(net, x, y, noise, delta, curvature):
    r"""A bound on a float32 evidence's distance from float64 (one prior precision ``delta``, Gaussian sites).

    Error model (ε = ε32): tests.helpers.float32_precision_error bounds ‖ΔH‖_F for :math:`H = \sum_n
    J_n^\top\Lambda_nJ_n + \delta I` (the Jacobian's rows, the sites, the sum over rows, the P-dimensional
    Cholesky's backward error), with ‖Λ_n‖ ≤ 1/σ² for the GGN and ≤ max r²/σ⁴ for the empirical Fisher (r = y − f;
    its sites move by 2|r||Δf|/σ⁴, within the helper's 8 max|Δf| relative for max|r| ≥ ¼, asserted);
    |Δ½log|H|| = ½|tr(H⁻¹ΔH)| ≤ ½‖H⁻¹‖_F‖ΔH‖_F (≤ ½√P κ‖ΔH‖_F/‖H‖, the condition of H measured on the dense
    float64 H); the data fit moves by
    ‖g‖‖Δf‖ (g = r/σ², ‖Δf‖ the helper's ``outputs``), and the sum of squares, the prior term and the result carry
    (log2 N + 2)ε of their magnitudes. A worst case over the roundings' directions: about 200ε32 relative for the
    GGN here (the empirical Fisher's H is worse conditioned: about 3000ε32), so an error of 1e-3 fails."""
    net64 = copy.deepcopy(net).double()
    x = x.double()
    j, _ = brute_jacobian(net64, x)
    with torch.no_grad():
        res = y.double().reshape(-1) - net64(x).reshape(-1)
    lam_max = 1 / noise if curvature == "ggn" else res.abs().max().item() ** 2 / noise**2
    assert curvature == "ggn" or res.abs().max() >= 0.25
    params = j.shape[1]
    error = float32_precision_error(net64, x, lam_max, gaussian=curvature == "ggn", factorized=params, delta=delta)
    lam = torch.full_like(res, 1 / noise) if curvature == "ggn" else res.square() / noise**2
    h = j.T @ (lam[:, None] * j) + delta * torch.eye(params, dtype=torch.float64)
    eig = torch.linalg.eigvalsh(h)
    theta_sq = sum(p.detach().double().square().sum() for p in net64.parameters()).item()
    magnitudes = (res.square().sum().item() / noise + len(res) * abs(math.log(2 * math.pi * noise))
                  + delta * theta_sq + params * abs(math.log(delta)) + torch.log(eig).abs().sum().item())
    return (0.5 * torch.linalg.matrix_norm(torch.linalg.inv(h)).item() * error["precision"] + (res.norm().item() / noise) * error["outputs"]
            + (math.log2(len(res)) + 2) * EPS32 * magnitudes)


def test_the_mlls_kept_eigen_data_follows_every_change():
    """The MLL keeps the eigen route's data by the values of the training inputs, the targets and the network (the
    network's outputs are read only to compute it): value and gradient against the Cholesky route, built anew,
    after each change, and against the data recomputed when nothing changed (one computation for two steps)."""
    import ntkgp.laplace.function_space.evidence as evidence_module  # where TrainingEvidence computes the data

    net, x, y = _problem(n=30)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.5, prior_structure="network").train()
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    computed = []
    original = evidence_module.spectral_data
    evidence_module.spectral_data = lambda *a, **k: computed.append(1) or original(*a, **k)
    try:
        def check(targets, curvature="ggn"):
            mll.curvature = curvature
            value = mll(model(model.train_x), targets) * model.num_data
            exact = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, curvature=curvature, method="cholesky")
            reference = exact(model(model.train_x), targets) * model.num_data
            params = [p for p in model.hyperparameters() if p.requires_grad]
            if model.dtype == torch.float32:  # the two routes' gradients differ by float32 rounding
                assert value.dtype == torch.float32
                bound = _float32_evidence_error(net, model.train_x, targets, lik.noise.item(),
                                                model.covar_module.prior_precision.item(), curvature)
                assert abs(value.item() - reference.item()) <= 2 * bound  # two float32 routes, each within it
                return
            assert rel_err(value.detach(), reference.detach()) < 1e-10
            for a, b in zip(torch.autograd.grad(value, params), torch.autograd.grad(reference, params)):
                assert rel_err(a, b) < 1e-10

        targets = y.clone()
        check(targets)
        check(targets)
        assert len(computed) == 1  # the second step from the kept data
        changes = [
            lambda: targets.mul_(-1.0),  # the caller's targets, changed in place
            lambda: net[0].weight.data.mul_(1.3),  # a write the version counter misses
            lambda: model.set_train_data(model.train_x + 0.5, strict=False),
            lambda: model.float(),  # the outputs and the algebra in float32: the data's dtype changes
            lambda: check(targets, curvature="ef"),  # the empirical Fisher: other data
        ]
        for change in changes:
            before = len(computed)
            change()
            check(targets)
            assert len(computed) > before
    finally:
        evidence_module.spectral_data = original
