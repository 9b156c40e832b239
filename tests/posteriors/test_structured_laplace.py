"""KFACLaplace and DiagLaplace against dense brute force: the precision as explicit Kronecker products (or the
diagonal of the explicit GGN / EF), explicit inverses, log-determinants and autograd Jacobians (float64, 1e-10)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntkgp.laplace.weight_space import compute_curvature
from ntkgp.laplace.weight_space import DiagLaplace, KFACLaplace, laplace_posterior
from tests.helpers import assert_unchanged, mlp, small_cnn, snapshot
from tests.posteriors.reference import (
    DTYPE,
    dense_curvature,
    kronecker_precision,
    likelihood_case,
    targets,
)
from tests.posteriors.reference import check_against, close
from ntkgp.laplace import PassOptions


def cnn_case(name: str = "softmax"):
    lik, c, log_prob = likelihood_case(name)
    net = small_cnn(c_out=c, seed=3)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 1, 6, 6, dtype=DTYPE, generator=g)
    return net, lik, log_prob, x, targets(name, 8), torch.randn(3, 1, 6, 6, dtype=DTYPE, generator=g)


def mlp_case(name: str):
    lik, c, log_prob = likelihood_case(name)
    net = mlp(3, 4, c, depth=2, seed=2)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(10, 3, dtype=DTYPE, generator=g)
    return net, lik, log_prob, x, targets(name, 10), torch.randn(4, 3, dtype=DTYPE, generator=g)


@pytest.mark.parametrize("damping", [False, True])
@pytest.mark.parametrize("name", ["gaussian", "multitask", "logistic", "softmax"])
def test_kfac_laplace_equals_explicit_kronecker_products(name, damping):
    net, lik, _, x, y, x_test = mlp_case(name)
    delta = torch.tensor([0.4, 1.7, 3.0], dtype=DTYPE)  # one per layer
    before = snapshot(net)
    posterior = KFACLaplace(net, x, y, lik, prior_precision=delta, damping=damping, options=PassOptions(batch_size=3))
    curvature = compute_curvature(net, x, y, lik, structure="kfac")
    check_against(posterior, net, x_test, kronecker_precision(net, curvature, lik, delta, damping))
    assert_unchanged(net, before)


def test_kfac_laplace_cnn_with_batchnorm_and_new_temperature():
    """Conv2d (several locations per example) in Kronecker form, BatchNorm on the exact diagonal."""
    net, lik, _, x, y, x_test = cnn_case()
    delta = torch.tensor([0.5, 2.0, 1.3], dtype=DTYPE)  # conv, bn, head
    curvature = compute_curvature(net, x, y, lik, structure="kfac")
    posterior = KFACLaplace.from_curvature(curvature, net, lik, prior_precision=delta, input_shape=(1, 6, 6))
    lik.temperature = 0.6
    check_against(posterior, net, x_test, kronecker_precision(net, curvature, lik, delta))
    flat = posterior.glm_covariance(x_test.flatten(1))
    close(flat, posterior.glm_covariance(x_test))


def test_kfac_equals_the_exact_posterior_for_one_example_and_one_layer():
    """For nn.Linear on one example the Kronecker block is the exact GGN block (independent of the curvature)."""
    lik, c, log_prob = likelihood_case("multitask")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, c)).double()
    x = torch.randn(1, 3, dtype=DTYPE)
    y = targets("multitask", 1)
    posterior = KFACLaplace(net, x, y, lik, prior_precision=0.8)
    precision = dense_curvature(net, x, y, log_prob) + 0.8 * torch.eye(3 * c + c, dtype=DTYPE)
    check_against(posterior, net, x, precision)


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("name", ["multitask", "logistic", "softmax"])
def test_diag_laplace_equals_the_diagonal_of_the_explicit_curvature(name, kind):
    net, lik, log_prob, x, y, x_test = mlp_case(name)
    delta = torch.tensor([0.4, 1.1, 1.7, 2.2, 3.0, 0.9], dtype=DTYPE)  # one per parameter tensor
    posterior = DiagLaplace(
        net, x, y, lik, curvature=kind, prior_precision=delta, prior_structure="parameter"
    )
    numels = [p.numel() for p in net.parameters()]
    delta_cols = torch.repeat_interleave(delta, torch.tensor(numels))
    precision = torch.diag(dense_curvature(net, x, y, log_prob, kind).diagonal() + delta_cols)
    check_against(posterior, net, x_test, precision)


def test_diag_laplace_cnn_conv_and_generic_routes():
    net, lik, log_prob, x, y, x_test = cnn_case()
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn", prior_precision=0.7)
    precision = torch.diag(dense_curvature(net, x, y, log_prob).diagonal() + 0.7)
    check_against(posterior, net, x_test, precision)


def test_front_door_dispatch_and_errors():
    net, lik, _, x, y, _ = mlp_case("softmax")
    assert type(laplace_posterior(net, x, y, lik, structure="full_ef")).__name__ == "FullLaplace"
    assert laplace_posterior(net, x, y, lik, structure="diag_ef").structure == "diag_ef"
    assert (
        type(laplace_posterior(net, x, y, lik, subset="last_layer", structure="full_ggn")).__name__
        == "LastLayerLaplace"
    )
    with pytest.raises(ValueError, match="structure"):
        laplace_posterior(net, x, y, lik, structure="lowrank")
    with pytest.raises(ValueError, match="subset"):
        laplace_posterior(net, x, y, lik, subset="first_layer")
    with pytest.raises(ValueError, match="subnetwork"):
        laplace_posterior(net, x, y, lik, subset="subnetwork", structure="kfac", subnetwork=["0.bias"])
    with pytest.raises(ValueError, match="prior_precision"):
        KFACLaplace(net, x, y, lik, prior_precision=torch.ones(2))
    with pytest.raises(TypeError, match="curvature"):
        DiagLaplace.from_curvature(compute_curvature(net, x, y, lik, structure="kfac"), net, lik)


def test_kfac_glm_never_forms_a_parameter_square(monkeypatch):
    """The KFAC predictive works from the factors: no P×P (nor block-sized) matrix is created."""
    net, lik, _, x, y, x_test = mlp_case("softmax")
    posterior = KFACLaplace(net, x, y, lik)
    p = posterior.num_params
    created = []
    original = torch.Tensor.__matmul__

    def watch(a, b):
        out = original(a, b)
        created.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", watch)
    posterior.glm_covariance(x_test)
    posterior.sample(5)
    posterior.log_det_precision()
    assert created and all(
        p not in shape[-2:] or len(shape) < 2 or shape[-1] != shape[-2] for shape in created
    )
    blocks = [b.index.numel() for b in posterior.blocks]
    assert all(not (shape[-1] in blocks and shape[-2] in blocks) for shape in created if len(shape) >= 2)


@pytest.mark.parametrize("structure", ["full_ggn", "kfac", "diag_ggn"])
def test_a_posterior_refuses_a_network_whose_weights_changed(structure):
    """The curvature belongs to the weights it was computed at: after an in-place change of the network every
    use raises (no silent mix of old curvature and new Jacobians); restoring the weights restores the posterior."""
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.laplace.weight_space.posterior.predictive_estimators import predict

    net = mlp(d_in=2, width=5, d_out=3)
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    posterior = laplace_posterior(net, x, y, SoftmaxLikelihood(3), structure=structure)
    xt = torch.randn(4, 2, dtype=torch.float64)
    before = posterior.glm_covariance(xt)
    with torch.no_grad():
        net[0].weight.mul_(3.0)
    for call in (lambda: posterior.glm_covariance(xt), lambda: predict(posterior, xt), lambda: posterior.sample(2)):
        with pytest.raises(RuntimeError, match="weights changed"):
            call()
    with torch.no_grad():
        net[0].weight.div_(3.0)
    torch.testing.assert_close(posterior.glm_covariance(xt), before)


@pytest.mark.parametrize("structure", ["full_ggn", "kfac", "diag_ggn"])
def test_prior_precision_is_copied_and_validated_before_the_pass(structure):
    """The posterior keeps its own copy of δ (a later change of the caller's tensor does not reach it, and the
    posterior never writes into it); a bool or a string is a TypeError naming prior_precision, before any pass
    over the data."""
    from ntkgp.likelihoods import SoftmaxLikelihood

    net = mlp(d_in=2, width=5, d_out=3)
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    delta = torch.tensor(0.1, dtype=torch.float64)
    posterior = laplace_posterior(net, x, y, SoftmaxLikelihood(3), structure=structure, prior_precision=delta)
    delta.fill_(10.0)
    assert torch.all(posterior.prior_precision == 0.1)
    posterior.prior_precision.mul_(5.0)
    assert delta.item() == 10.0
    for bad in (True, "1"):
        with pytest.raises(TypeError, match="prior_precision"):
            laplace_posterior(net, x, y, SoftmaxLikelihood(3), structure=structure, prior_precision=bad)
    with pytest.raises(TypeError, match="prior_precision"):
        posterior.prior_precision = True
    import numpy as np

    groups = posterior.prior_precision.shape[0]
    for value in (np.float32(2.0), np.int64(2), np.full(groups, 2.0), [2.0] * groups):  # numbers, arrays, lists
        posterior.prior_precision = value
        assert posterior.prior_precision.dtype == torch.float64 and torch.all(posterior.prior_precision == 2.0)
    array = np.full(groups, 3.0)
    posterior.prior_precision = array
    array[0] = -5.0  # the caller's array, changed later: not the posterior's copy
    assert torch.all(posterior.prior_precision == 3.0)


def test_a_last_layer_posterior_refuses_a_changed_body():
    """The body under a last-layer posterior is not copied (a fingerprint is kept): a change of it is still seen."""
    from ntkgp.likelihoods import SoftmaxLikelihood

    net = mlp(d_in=2, width=5, d_out=3)
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    posterior = laplace_posterior(net, x, y, SoftmaxLikelihood(3), structure="full_ggn", subset="last_layer")
    xt = torch.randn(4, 2, dtype=torch.float64)
    posterior.glm_covariance(xt)
    with torch.no_grad():
        net[0].weight[0, 0] += 1e-3  # the body, outside the posterior
    with pytest.raises(RuntimeError, match="weights changed"):
        posterior.glm_covariance(xt)


def test_predict_reports_inputs_that_do_not_fit_the_network():
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.laplace.weight_space.posterior.predictive_estimators import predict

    net = mlp(d_in=2, width=5, d_out=3)
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randint(0, 3, (12,))
    posterior = laplace_posterior(net, x, y, SoftmaxLikelihood(3), structure="kfac")
    for bad in (torch.ones(3, 2, dtype=torch.long), torch.randn(3, 4, dtype=torch.float64)):
        with pytest.raises(ValueError, match="x of shape"):
            predict(posterior, bad)
    with pytest.raises(ValueError, match="step_size"):
        predict(posterior, torch.randn(3, 2, dtype=torch.float64), method="mc_glm", step_size=True)
