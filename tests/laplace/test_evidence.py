"""The Laplace layer's evidence: every dense route (function and weight space, the kernel's own covariance or a
given one) against the dense weight-space brute force of tests.helpers.dense_laplace."""

import pytest
import torch
from linear_operator.operators import DenseLinearOperator, LowRankRootLinearOperator

import ntkgp
from ntkgp.laplace.function_space import laplace_log_marginal_likelihood
from ntkgp.ntk import resolve_groups
from tests.helpers import brute_jacobian, column_groups, dense_laplace, rel_err
from tests.problems import KINDS, make_problem

DELTA = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)


def _delta_columns(net):
    groups = resolve_groups(net)
    return DELTA[column_groups(net, dict(zip(groups.names, groups.group_of)))]


@pytest.mark.parametrize("curvature", ["ggn", "ef"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_route_equals_the_dense_brute_force(kind, curvature):
    net, x, y, lik, log_prob = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    kernel, f, yy = model.covar_module, model.train_outputs, model.train_y
    reference = dense_laplace(net, x, y, log_prob, _delta_columns(net), curvature)["evidence"]
    # the root J P0^{-1/2} and the dense K built here from brute-force Jacobians, not by the kernel
    j, _ = brute_jacobian(net, x)  # (N·C, P), rows n·C + c
    root = LowRankRootLinearOperator(j * _delta_columns(net).rsqrt())
    dense = DenseLinearOperator(root.to_dense())
    routes = {
        "function": laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "function"),
        "weight": laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "weight"),
        "given root": laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "weight", covariance=root),
        "given dense": laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "function",
                                                       covariance=dense),
    }
    for name, value in routes.items():
        assert rel_err(value.detach(), reference) < 1e-10, name


def test_kernel_column_weights_expand_the_group_precisions():
    net, x, y, lik, _ = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    weights = model.covar_module.column_weights(-1.0)
    sizes = [p.numel() for p in net.parameters()]  # weight/bias of each of the 3 layers
    expected = torch.cat([torch.full((s,), 1 / d) for s, d in zip(sizes, [0.5, 0.5, 2.0, 2.0, 4.0, 4.0])]).double()
    assert torch.allclose(weights, expected)


def test_bad_options_are_named():
    net, x, y, lik, _ = make_problem("binary")
    model = ntkgp.NTKGP(net, x, y, lik)
    with pytest.raises(ValueError, match="curvature"):
        model.log_marginal_likelihood(curvature="fisher")
    with pytest.raises(ValueError, match="space"):
        model.log_marginal_likelihood(space="dense")
