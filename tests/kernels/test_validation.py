"""NTKKernel's arguments: validation before any side effect, prior-precision setter, old names, caching."""

from unittest import mock

import pytest
import torch
from gpytorch.constraints import Interval

from ntkgp import NTKKernel
from ntkgp.ntk import NTKEngine, resolve_groups
from tests.helpers import assert_unchanged, brute_gram, column_groups, mlp, rel_err, small_cnn, snapshot

D64 = torch.float64


def labels_of(net, prior_structure="layer"):
    pg = resolve_groups(net, prior_structure)
    return dict(zip(pg.names, pg.group_of))


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0.0, ValueError, "positive and finite"),
        (-1.0, ValueError, "positive and finite"),
        (float("inf"), ValueError, "positive and finite"),
        (float("nan"), ValueError, "positive and finite"),
        (torch.tensor([1.0, 0.0, 2.0]), ValueError, "positive and finite"),
        (torch.ones(2), ValueError, r"one value per group \(3"),
        (torch.ones(3, 3), ValueError, r"one value per group \(3"),
        (True, TypeError, "float or a real tensor"),
        ("big", TypeError, "float or a real tensor"),
        (torch.ones(3, dtype=torch.complex128), TypeError, "float or a real tensor"),
    ],
)
def test_setter_validates_as_the_constructor(value, error, match):
    kernel = NTKKernel(mlp(), prior_precision=torch.tensor([0.5, 2.0, 3.0], dtype=D64))
    before = kernel.prior_precision.detach().clone()
    with pytest.raises(error, match=f"prior_precision must.*{match}|{match}"):
        kernel.prior_precision = value
    assert torch.equal(kernel.prior_precision.detach(), before)  # nothing written
    with pytest.raises(error, match=match):
        NTKKernel(mlp(), prior_precision=value)


def test_setter_respects_the_constraint_and_accepts_good_values():
    kernel = NTKKernel(mlp(), prior_precision=1.0, prior_precision_constraint=Interval(0.1, 10.0))
    with pytest.raises(ValueError, match="prior_precision must lie inside its constraint"):
        kernel.prior_precision = 100.0
    kernel.prior_precision = [0.2, 3.0, 9.0]
    assert torch.allclose(kernel.prior_precision, torch.tensor([0.2, 3.0, 9.0], dtype=D64))
    kernel.prior_precision = torch.tensor(2.0)  # a scalar of another dtype
    assert kernel.prior_precision.dtype == D64 and torch.allclose(
        kernel.prior_precision, torch.full((3,), 2.0, dtype=D64)
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"space": "dense"}, ValueError, "space must be one of"),
        ({"strategy": "fast"}, ValueError, "strategy must be one of"),
        ({"prior_structure": "block"}, ValueError, "prior_structure must be one of"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be an integer"),
        ({"chunk_size": 2.7}, ValueError, "chunk_size must be an integer"),
        ({"cache_size": -1}, ValueError, "cache_size must be an integer"),
        ({"progress": "yes"}, TypeError, "progress must be True, False or None"),
        ({"input_shape": (3, 0)}, ValueError, "input_shape must be an integer"),
        ({"input_shape": "3"}, ValueError, "input_shape must be a non-empty tuple"),
        ({"batch_shape": (2, -1)}, ValueError, "batch_shape must be a tuple"),
        ({"prior_precision_prior": 3.0}, TypeError, "prior_precision_prior must be a gpytorch Prior"),
        ({"prior_precision_constraint": "positive"}, TypeError, "prior_precision_constraint must be"),
        ({"prior_precison": 1.0}, TypeError, "unexpected keyword arguments"),
    ],
)
def test_constructor_rejects_bad_arguments_before_building_anything(kwargs, error, match):
    net = mlp()
    before = snapshot(net)
    with mock.patch.object(NTKEngine, "__init__", side_effect=AssertionError("engine built")):
        with pytest.raises(error, match=match):
            NTKKernel(net, **kwargs)
    assert_unchanged(net, before)


@pytest.mark.parametrize("old", [{"groups": "network"}, {"representation": "root"}])
def test_removed_names_are_unknown_keywords(old):
    """``groups=`` and ``representation=`` were deprecated names; 0.1.0 has no users: they are refused."""
    with pytest.raises(TypeError, match=f"unexpected keyword arguments \\['{next(iter(old))}'\\]"):
        NTKKernel(mlp(d_out=2), **old)
    assert not hasattr(NTKKernel, "groups_spec") and not hasattr(NTKKernel, "_column_weights")


def test_space_forms():
    from linear_operator.operators import DenseLinearOperator, LowRankRootLinearOperator, MatmulLinearOperator

    net = mlp(d_out=2)
    x1, x2 = torch.randn(10, 3, dtype=D64), torch.randn(12, 3, dtype=D64)
    assert isinstance(NTKKernel(net, space="weight")(x1).evaluate_kernel(), LowRankRootLinearOperator)
    assert isinstance(NTKKernel(net, space="weight")(x1, x2).evaluate_kernel(), MatmulLinearOperator)
    assert isinstance(
        NTKKernel(net, space="function")(torch.randn(80, 3, dtype=D64)).evaluate_kernel(), DenseLinearOperator
    )


def test_column_weights():
    net = mlp(d_out=2)
    delta = torch.tensor([0.5, 2.0, 3.0], dtype=D64)
    kernel = NTKKernel(net, prior_precision=delta)
    cols = column_groups(net, labels_of(net))
    for power in (-1.0, -0.5, 1.0):
        assert torch.allclose(kernel.column_weights(power), delta[cols] ** power, rtol=1e-14)
    (grad,) = torch.autograd.grad(kernel.column_weights(1.0).sum(), kernel.raw_prior_precision)
    assert grad.shape == (3,)


@pytest.mark.parametrize("space", ["function", "weight"])
def test_cache_sees_every_change_of_the_network(space):
    """Weights written in place, through ``.data``, by ``load_state_dict``; BatchNorm buffers: never stale."""
    net = mlp(d_out=2)
    x = torch.randn(6, 3, dtype=D64)
    kernel = NTKKernel(net, space=space)
    ones = torch.ones(3, dtype=D64)

    def check():
        assert rel_err(kernel(x).to_dense(), brute_gram(net, x, x, ones, labels_of(net))) < 1e-10

    check()
    with torch.no_grad():
        net[0].weight.mul_(1.5)
    check()
    net[2].weight.data = net[2].weight.data * 0.5  # a new tensor behind the same Parameter
    check()
    state = {k: v * 1.1 for k, v in net.state_dict().items()}
    net.load_state_dict(state)
    check()
    cnn = small_cnn(c_out=2)
    xi = torch.randn(3, 36, dtype=D64)
    ck = NTKKernel(cnn, input_shape=(1, 6, 6), space=space)
    first = ck(xi).to_dense()
    cnn.bn.running_var.mul_(3.0)
    second = ck(xi).to_dense()
    delta = torch.ones(3, dtype=D64)
    assert (
        rel_err(second, brute_gram(cnn, xi.view(3, 1, 6, 6), xi.view(3, 1, 6, 6), delta, labels_of(cnn)))
        < 1e-10
    )
    assert rel_err(first, second) > 1e-3


def test_cache_is_not_used_for_inputs_that_require_grad():
    net = mlp(d_out=2)
    kernel = NTKKernel(net, space="function")
    x = torch.randn(5, 3, dtype=D64)
    kernel(x).to_dense()
    assert len(kernel._cache) == 1
    xg = x.clone().requires_grad_(True)
    k = kernel(xg).to_dense()
    assert len(kernel._cache) == 1 and k.requires_grad


def test_point_blocks_mean_and_empty_diagonals_follow_gpytorch_input_conventions():
    """1-D inputs are (N,) points of one feature for point_blocks as for k(x); the mean rejects non-tensors with a
    TypeError naming x, and integer inputs (passed to the network as they are, for token ids) that a float network
    does not take with a ValueError naming x; an empty input gives an empty diagonal, as the full matrix."""
    import ntkgp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    kernel = ntkgp.NTKKernel(net)
    x = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(kernel.point_blocks(x), kernel.point_blocks(x[:, None]), rtol=0, atol=0)
    mean = ntkgp.LinearizedNetworkMean(kernel.engine)
    for bad, kind, match in (([[0.5]], TypeError, "x must be"),
                             (torch.ones(3, 1, dtype=torch.long), ValueError, r"x of .*int64 does not fit.*\.to\(")):
        with pytest.raises(kind, match=match):
            mean(bad)
    empty = torch.zeros(0, 1, dtype=torch.float64)
    assert kernel(empty, diag=True).shape == (0,) and kernel(empty).to_dense().shape == (0, 0)
