"""NTKKernel against brute-force J P0⁻¹ Jᵀ, and its GPyTorch behavior."""

from unittest import mock

import gpytorch
import pytest
import torch
from linear_operator.operators import DenseLinearOperator, LowRankRootLinearOperator

from ntkgp import NTKKernel
from ntkgp.ntk import NTKEngine, resolve_groups
from tests.helpers import assert_unchanged, brute_gram, float32_gram_tolerance, mlp, rel_err, small_cnn, snapshot


def labels_of(net, groups="layer"):
    pg = resolve_groups(net, groups)
    return dict(zip(pg.names, pg.group_of))


@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("space", ["function", "weight", "auto"])
def test_kernel_matches_brute_force(c, space):
    net = mlp(d_out=c)
    delta = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    kernel = NTKKernel(net, prior_precision=delta, space=space)
    x1, x2 = torch.randn(8, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    before = snapshot(net)
    k11, k12 = kernel(x1).to_dense(), kernel(x1, x2).to_dense()
    assert_unchanged(net, before)
    assert k11.shape == (8 * c, 8 * c) and k12.shape == (8 * c, 4 * c)
    assert rel_err(k11, brute_gram(net, x1, x1, delta, labels_of(net))) < 1e-10
    assert rel_err(k12, brute_gram(net, x1, x2, delta, labels_of(net))) < 1e-10
    assert torch.allclose(kernel(x1, diag=True), k11.diagonal(), rtol=1e-10, atol=1e-14)
    assert torch.allclose(k11, k11.T, atol=1e-12)
    assert torch.linalg.eigvalsh(k11).min() > -1e-10 * k11.diagonal().max()


def test_cnn_with_batchnorm_and_images():
    net = small_cnn(c_out=2)
    x = torch.randn(6, 1, 6, 6, dtype=torch.float64)
    kernel = NTKKernel(
        net, prior_precision=torch.linspace(0.5, 2.0, 3, dtype=torch.float64), input_shape=(1, 6, 6)
    )
    delta = kernel.prior_precision.detach()
    k = kernel(x.flatten(1)).to_dense()
    assert rel_err(k, brute_gram(net, x, x, delta, labels_of(net))) < 1e-10


def test_space_chosen_by_cost():
    net = mlp(d_out=2)  # P = 3*7+7 + 7*7+7 + 7*2+2 = 100
    kernel = NTKKernel(net)
    small, large = torch.randn(10, 3, dtype=torch.float64), torch.randn(60, 3, dtype=torch.float64)
    assert isinstance(kernel(small).evaluate_kernel(), DenseLinearOperator)  # N·C = 20 < P
    assert isinstance(kernel(large).evaluate_kernel(), LowRankRootLinearOperator)  # N·C = 120 > P
    op = kernel(large).evaluate_kernel().add_diagonal(torch.tensor(0.1, dtype=torch.float64))
    dense = kernel(large).to_dense() + 0.1 * torch.eye(120, dtype=torch.float64)
    rhs = torch.randn(120, 2, dtype=torch.float64)
    assert rel_err(op.solve(rhs), torch.linalg.solve(dense, rhs)) < 1e-8
    assert abs(op.logdet() - torch.logdet(dense)) < 1e-8


@pytest.mark.parametrize("space", ["function", "weight"])
def test_reweighting_equals_recomputation_without_new_jacobians(space):
    net = mlp(d_out=2)
    x = torch.randn(12, 3, dtype=torch.float64)
    kernel = NTKKernel(net, space=space)
    kernel(x).to_dense()
    kernel(x, diag=True)
    new_delta = torch.tensor([0.3, 4.0, 1.5], dtype=torch.float64)
    kernel.prior_precision = new_delta
    recomputed = AssertionError("recomputed")
    with (
        mock.patch.object(NTKEngine, "group_grams", side_effect=recomputed),
        mock.patch.object(NTKEngine, "jacobian", side_effect=recomputed),
        mock.patch.object(NTKEngine, "diag_blocks", side_effect=recomputed),
    ):
        reweighted = kernel(x).to_dense()
        diagonal = kernel(x, diag=True)
    fresh = NTKKernel(net, prior_precision=new_delta, space=space)(x).to_dense()
    assert rel_err(diagonal, fresh.diagonal()) < 1e-13
    assert rel_err(reweighted, fresh) < 1e-13


def test_cache_invalidated_when_weights_change():
    net = mlp(d_out=1)
    x = torch.randn(5, 3, dtype=torch.float64)
    kernel = NTKKernel(net)
    k_before = kernel(x).to_dense()
    with torch.no_grad():
        net[0].weight.mul_(1.5)
    k_after = kernel(x).to_dense()
    assert rel_err(k_after, brute_gram(net, x, x, torch.ones(3, dtype=torch.float64), labels_of(net))) < 1e-10
    assert rel_err(k_after, k_before) > 1e-3


@pytest.mark.parametrize("space", ["function", "weight"])
def test_cache_invalidated_when_a_frozen_parameter_changes(space):
    """A frozen parameter is not a column of J but changes it: the kernel (and a model's predictions) follow
    an in-place change of it, as brute-force Jacobians of the changed network do."""
    import ntkgp

    net = mlp(d_out=1)
    net[0].weight.requires_grad_(False)
    x, xt = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    kernel = NTKKernel(net, space=space)
    labels = labels_of(net)
    delta = torch.ones(max(labels.values()) + 1, dtype=torch.float64)
    k_before = kernel(x).to_dense()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, torch.randn(5, dtype=torch.float64), lik, space=space).eval()
    with torch.no_grad():
        model(xt).variance  # fills the model's caches
        net[0].weight.add_(0.5)
    k_after = kernel(x).to_dense()
    assert rel_err(k_after, brute_gram(net, x, x, delta, labels)) < 1e-10
    assert rel_err(k_after, k_before) > 1e-3
    with torch.no_grad():
        fresh = ntkgp.NTKGP(net, x, model.train_y, lik, space=space).eval()
        assert rel_err(model(xt).variance, fresh(xt).variance) < 1e-12
        assert rel_err(model(xt).mean, fresh(xt).mean) < 1e-12


@pytest.mark.parametrize("space", ["function", "weight"])
def test_gradient_wrt_prior_precision_matches_finite_differences(space):
    net = mlp(d_out=2)
    x = torch.randn(15, 3, dtype=torch.float64)
    kernel = NTKKernel(net, prior_precision=torch.tensor([0.7, 1.3, 2.0], dtype=torch.float64), space=space)

    def objective(raw):
        kernel.raw_prior_precision.data.copy_(raw)
        op = kernel(x).evaluate_kernel().add_diagonal(torch.tensor(0.5, dtype=torch.float64))
        return op.logdet()

    raw0 = kernel.raw_prior_precision.detach().clone()
    value = objective(raw0)
    (grad,) = torch.autograd.grad(value, kernel.raw_prior_precision)
    eps = 1e-6
    for g in range(3):
        step = torch.zeros(3, dtype=torch.float64)
        step[g] = eps
        fd = (objective(raw0 + step).item() - objective(raw0 - step).item()) / (2 * eps)
        assert abs(fd - grad[g].item()) < 1e-6 * max(1.0, abs(fd))


def test_prior_precision_is_a_gpytorch_hyperparameter():
    net = mlp()
    prior = gpytorch.priors.GammaPrior(2.0, 1.0)
    kernel = NTKKernel(net, prior_precision=2.0, prior_precision_prior=prior)
    assert [n for n, _ in kernel.named_hyperparameters()] == ["raw_prior_precision"]
    assert torch.allclose(kernel.prior_precision, torch.full((3,), 2.0, dtype=torch.float64))
    assert [n for n, *_ in kernel.named_priors()] == ["prior_precision_prior"]
    assert not any(name.startswith(("0.", "1.", "2.")) or "weight" in name for name in kernel.state_dict())
    with pytest.raises(ValueError, match="prior_precision must"):
        NTKKernel(net, prior_precision=torch.ones(2))
    with pytest.raises(ValueError, match="positive"):
        NTKKernel(net, prior_precision=-1.0)


def test_kernel_in_a_multitask_gp():
    """The kernel drops into an ordinary GPyTorch ExactGP with interleaved multitask outputs."""
    net = mlp(d_out=2)
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)

    class GP(gpytorch.models.ExactGP):
        def __init__(self, likelihood):
            super().__init__(x, y, likelihood)
            self.covar_module = NTKKernel(net)

        def forward(self, inputs):
            covar = self.covar_module(inputs)
            return gpytorch.distributions.MultitaskMultivariateNormal(
                torch.zeros(inputs.shape[0], 2, dtype=inputs.dtype), covar
            )

    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0).double()
    model = GP(likelihood).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    loss = -mll(model(x), y)
    loss.backward()
    assert model.covar_module.raw_prior_precision.grad is not None
    assert all(p.grad is None for p in net.parameters())
    model.eval()
    x_test = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        pred = model(x_test)
    k = model.covar_module
    kxx = k(x).to_dense() + torch.diag_embed(likelihood.task_noises.repeat(10) + likelihood.noise)
    kst = k(x_test, x).to_dense()
    mean_ref = (kst @ torch.linalg.solve(kxx, y.reshape(-1))).reshape(4, 2)
    assert rel_err(pred.mean, mean_ref) < 1e-8


def test_float32_kernel_agrees_with_float64():
    x = torch.randn(30, 3, dtype=torch.float64)
    k64 = NTKKernel(mlp(d_out=2))(x).to_dense()
    k32 = NTKKernel(mlp(d_out=2, dtype=torch.float32))(x.float()).to_dense()
    tolerance = float32_gram_tolerance(mlp(d_out=2), k64.diagonal())  # ε times the rounding count, tr K
    assert k32.dtype == torch.float32 and (k32.double() - k64).norm() <= tolerance


def test_a_network_switched_to_training_mode_is_refused_even_on_cache_hits():
    """Built on an eval-mode network with BatchNorm, then net.train(): every call raises (the cached results
    belong to the eval-mode network), and net.eval() makes the objects usable again."""
    import ntkgp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 1)).double()
    net(torch.randn(20, 2, dtype=torch.float64))
    net.eval()
    x, xt = torch.randn(8, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, torch.randn(8, dtype=torch.float64), lik).eval()
    kernel = NTKKernel(net)
    with torch.no_grad():
        before = model(xt).variance, kernel(xt).to_dense()
    net.train()
    for call in (lambda: model(xt).variance, lambda: kernel(xt).to_dense(), model.log_marginal_likelihood):
        with pytest.raises(ValueError, match="training mode"), torch.no_grad():
            call()
    net.eval()
    with torch.no_grad():
        assert torch.equal(model(xt).variance, before[0]) and torch.equal(kernel(xt).to_dense(), before[1])
