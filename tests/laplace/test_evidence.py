"""The Laplace layer's evidence: routes (function, weight, given covariance) agree; deprecated entry points."""

import pytest
import torch
from linear_operator.operators import DenseLinearOperator, LowRankRootLinearOperator

import ntkgp
from ntkgp.laplace.function_space import column_weights, laplace_log_marginal_likelihood
from tests.helpers import rel_err
from tests.mlls.test_laplace_ggn_evidence import KINDS, make_problem


@pytest.mark.parametrize("curvature", ["ggn", "ef"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_route_gives_the_same_evidence(kind, curvature):
    net, x, y, lik, _ = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64))
    kernel, f, yy = model.covar_module, model.train_outputs, model.train_y
    function = laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "function")
    weight = laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "weight")
    root = LowRankRootLinearOperator(kernel.jacobian(x) * column_weights(kernel, -0.5))
    dense = DenseLinearOperator(root.to_dense())
    given_root = laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "weight", covariance=root)
    given_dense = laplace_log_marginal_likelihood(kernel, lik, x, f, yy, curvature, "function", covariance=dense)
    for value in (weight, given_root, given_dense):
        assert rel_err(value.detach(), function.detach()) < 1e-10


def test_column_weights_expand_the_group_precisions():
    net, x, y, lik, _ = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64))
    weights = column_weights(model.covar_module, -1.0)
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

