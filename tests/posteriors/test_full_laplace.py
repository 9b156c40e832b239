"""FullLaplace and LastLayerLaplace against dense brute force: explicit GGN / EF from autograd Jacobians and
torch.distributions likelihood terms, explicit inverses and log-determinants (float64, 1e-10)."""

from __future__ import annotations

import pytest
import torch

from ntkgp.laplace.weight_space import FullLaplace, LastLayerLaplace
from tests.helpers import assert_unchanged, float32_precision_error, mlp, snapshot
from tests.posteriors.reference import (
    DTYPE,
    LIKELIHOODS,
    check_against,
    close,
    dense_curvature,
    likelihood_case,
    targets,
)
from ntkgp.laplace import PassOptions


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("name", LIKELIHOODS)
def test_full_laplace_equals_dense_brute_force(name, kind):
    lik, c, log_prob = likelihood_case(name)
    net = mlp(3, 4, c, depth=1, seed=1)
    x = torch.randn(9, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    y = targets(name, 9)
    x_test = torch.randn(4, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    delta = torch.tensor([0.7, 2.5], dtype=DTYPE)  # one per layer: per-group prior precisions
    before = snapshot(net)
    posterior = FullLaplace(net, x, y, lik, curvature=kind, prior_precision=delta, options=PassOptions(batch_size=4))
    delta_cols = torch.cat([delta[0].expand(3 * 4 + 4), delta[1].expand(4 * c + c)])
    precision = dense_curvature(net, x, y, log_prob, kind) + torch.diag(delta_cols)
    check_against(posterior, net, x_test, precision)
    assert_unchanged(net, before)


@pytest.mark.parametrize("name", ["multitask", "softmax"])
def test_full_laplace_follows_new_noise_temperature_and_prior_precision(name):
    lik, c, log_prob = likelihood_case(name)
    net = mlp(3, 4, c, depth=1, seed=1)
    x = torch.randn(9, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    y = targets(name, 9)
    posterior = FullLaplace(net, x, y, lik, prior_precision=1.0)
    first = posterior.log_det_precision()
    if name == "multitask":
        lik.task_noises = torch.tensor([0.05, 1.5], dtype=DTYPE)
    else:
        lik.temperature = 0.4
    posterior.prior_precision = torch.tensor([3.0, 0.2], dtype=DTYPE)
    delta_cols = torch.cat([torch.full((16,), 3.0, dtype=DTYPE), torch.full((4 * c + c,), 0.2, dtype=DTYPE)])
    precision = dense_curvature(net, x, y, log_prob) + torch.diag(delta_cols)
    close(posterior.dense_precision(), precision)
    close(posterior.log_det_precision(), torch.linalg.slogdet(precision)[1])
    assert not torch.isclose(first, posterior.log_det_precision())


def test_temperature_scales_the_curvature():
    """Σ = (H(T=1)/T + P0)⁻¹: the tempered posterior from the untempered brute-force GGN."""
    lik, c, _ = likelihood_case("softmax")
    net = mlp(3, 4, c, depth=1, seed=1)
    x = torch.randn(9, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    y = targets("softmax", 9)
    from tests.helpers import reference_log_prob

    untempered = dense_curvature(net, x, y, lambda f, t: reference_log_prob("softmax", f, t))
    lik.temperature = 2.5
    posterior = FullLaplace(net, x, y, lik, prior_precision=0.5)
    close(posterior.dense_precision(), untempered / 2.5 + 0.5 * torch.eye(untempered.shape[0], dtype=DTYPE))


@pytest.mark.parametrize("name", ["gaussian", "softmax"])
def test_last_layer_laplace_equals_dense_brute_force(name):
    lik, c, log_prob = likelihood_case(name)
    net = mlp(3, 5, c, depth=2, seed=4)
    x = torch.randn(11, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    y = targets(name, 11)
    x_test = torch.randn(5, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    delta = torch.tensor([0.3, 4.0], dtype=DTYPE)
    posterior = LastLayerLaplace(net, x, y, lik, prior_precision=delta, prior_structure="parameter")
    names = ["4.weight", "4.bias"]
    assert posterior.names == names and posterior.layer == "4"
    delta_cols = torch.cat([delta[0].expand(5 * c), delta[1].expand(c)])
    precision = dense_curvature(net, x, y, log_prob, "ggn", names) + torch.diag(delta_cols)
    check_against(posterior, net, x_test, precision, names)


def test_last_layer_named_layer_and_errors():
    lik, c, _ = likelihood_case("gaussian")
    net = mlp(3, 5, c, depth=2, seed=4)
    x = torch.randn(6, 3, dtype=DTYPE)
    y = targets("gaussian", 6)
    assert LastLayerLaplace(net, x, y, lik, layer="2").names == ["2.weight", "2.bias"]
    with pytest.raises(ValueError, match="layer"):
        LastLayerLaplace(net, x, y, lik, layer="1")  # Tanh: no parameters


def test_full_laplace_accepts_batches_and_float32():
    lik, c, _log_prob = likelihood_case("softmax")
    net = mlp(3, 4, c, depth=1, seed=1)
    x = torch.randn(9, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    y = targets("softmax", 9)
    loader = list(zip(x.split(4), y.split(4)))
    a = FullLaplace(net, loader, None, lik)
    b = FullLaplace(net, x, y, lik, options=PassOptions(batch_size=9))
    close(a.dense_precision(), b.dense_precision())
    net32 = mlp(3, 4, c, depth=1, seed=1, dtype=torch.float32)
    p32 = FullLaplace(net32, x.float(), y, lik.float())
    assert p32.glm_covariance(x.float()).dtype == torch.float32
    # the error model of tests.helpers.float32_precision_error (softmax sites: ‖Λ_n‖ ≤ ½ / temperature)
    precision = b.dense_precision()
    bound = float32_precision_error(net, x, 0.5 / float(lik.temperature))["precision"]
    assert bound < 1e-2 * precision.norm()  # a meaningful bound: a 1 % error fails
    assert (p32.dense_precision().double() - precision).norm() <= bound


def test_input_validation_before_any_pass():
    lik, c, _ = likelihood_case("softmax")
    net = mlp(3, 4, c, depth=1, seed=1)
    x = torch.randn(5, 3, dtype=DTYPE)
    y = targets("softmax", 5)
    with pytest.raises(ValueError, match="curvature"):
        FullLaplace(net, x, y, lik, curvature="hessian")
    with pytest.raises(ValueError, match="prior_precision"):
        FullLaplace(net, x, y, lik, prior_precision=-1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        FullLaplace(net, x, y, lik, prior_precision=torch.ones(3))
    with pytest.raises(ValueError, match="prior_structure"):
        FullLaplace(net, x, y, lik, prior_structure="module")
    with pytest.raises(TypeError, match="likelihood"):
        FullLaplace(net, x, y, "softmax")
    with pytest.raises(ValueError, match="batch_size"):
        FullLaplace(net, x, y, lik, options=PassOptions(batch_size=0))
    posterior = FullLaplace(net, x, y, lik)
    with pytest.raises(ValueError, match="v must have shape"):
        posterior.covariance_matmul(torch.ones(3, dtype=DTYPE))
    with pytest.raises(ValueError, match="num_samples"):
        posterior.sample(0)
