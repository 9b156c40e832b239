"""A lazy NTK tensor ``kernel(x1, x2)`` is the kernel of the moment it was made (docs/guarantees.md, "Distributions
are snapshots"): δ set, the network's weights written (``.data``, an optimizer step), a buffer changed, a parameter
frozen, one evidence step of an ``ExactNTKGP`` taken between creating the tensor and reading it, and what is read
(dense matrix, diagonal, products, entries, slices, transposes) is ``Σ_g δ_g⁻¹ J_g(x1) J_g(x2)ᵀ`` at the old values,
from brute-force Jacobians (``torch.autograd.grad`` row by row on a copy of the network taken before the change)."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch
from torch import nn

import ntkgp
from ntkgp import NTKKernel
from tests.helpers import brute_gram, mlp

DELTA = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
LAYERS = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1, "4.weight": 2, "4.bias": 2}
# float64 throughout: the lazy tensor and the reference form the same products, agreeing to rounding (ε64 times
# the entries' magnitude, O(1) here); a stale read differs by O(0.1-1)
TOL = dict(rtol=1e-9, atol=1e-11)


def _setup(space: str):
    net = mlp(d_in=3, width=6, d_out=2, seed=1)
    kernel = NTKKernel(net, prior_precision=DELTA, space=space)
    torch.manual_seed(2)
    x1, x2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    return net, kernel, x1, x2


def _set_delta(net, kernel):
    kernel.prior_precision = DELTA * 4


def _write_data(net, kernel):
    net[0].weight.data.mul_(1.5)


def _optimizer_step(net, kernel):
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    net(torch.randn(6, 3, dtype=torch.float64)).square().sum().backward()
    opt.step()


def _both(net, kernel):
    _set_delta(net, kernel)
    _write_data(net, kernel)


CHANGES = {"delta": _set_delta, "data": _write_data, "step": _optimizer_step, "delta_and_weights": _both}


@pytest.mark.parametrize("space", ["function", "weight"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_kernel_tensor_reads_the_values_of_its_creation(space, change):
    net, kernel, x1, x2 = _setup(space)
    old = copy.deepcopy(net)
    square, cross = kernel(x1), kernel(x1, x2)
    assert isinstance(square, ntkgp.kernels.lazy.NTKLazyKernelTensor)
    v = torch.randn(cross.shape[-1], 3, dtype=torch.float64)
    rows, cols = torch.tensor([0, 3, 7, 9]), torch.tensor([1, 2, 7, 8])  # entries in and off the point blocks
    CHANGES[change](net, kernel)
    ref_square = brute_gram(old, x1, x1, DELTA, LAYERS)
    ref_cross = brute_gram(old, x1, x2, DELTA, LAYERS)
    assert (brute_gram(net, x1, x2, kernel.prior_precision.detach(), LAYERS) - ref_cross).abs().max() > 1e-2
    torch.testing.assert_close(cross.to_dense(), ref_cross, **TOL)
    torch.testing.assert_close(cross @ v, ref_cross @ v, **TOL)
    torch.testing.assert_close(cross.mT.to_dense(), ref_cross.mT, **TOL)
    torch.testing.assert_close(cross[..., 2:6, 0:4].to_dense(), ref_cross[2:6, 0:4], **TOL)
    torch.testing.assert_close(square.diagonal(), ref_square.diagonal(), **TOL)
    torch.testing.assert_close(square[..., rows, cols], ref_square[rows, cols], **TOL)
    torch.testing.assert_close(square.to_dense(), ref_square, **TOL)


def test_a_kernel_tensor_read_before_any_change_stays_live_and_differentiable():
    """While nothing changed the live kernel evaluates it: its graph to δ is there (gradients as GPyTorch's)."""
    net, kernel, x1, _ = _setup("function")
    tensor = kernel(x1)
    assert tensor.kernel is kernel
    tensor.to_dense().sum().backward()
    grad = kernel.raw_prior_precision.grad
    assert grad is not None and bool((grad != 0).all())


def test_a_frozen_parameter_or_a_buffer_changed_after_creation():
    """A buffer (BatchNorm statistics in eval mode) is copied, and a parameter frozen after creation is still
    differentiated as it was when the tensor was made; a frozen parameter whose values changed cannot be restored
    (only fingerprinted): that raises rather than mixing."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2)).double()
    net[1].running_mean.uniform_(-0.5, 0.5)
    net[1].running_var.uniform_(0.5, 2.0)
    net.eval()
    kernel = NTKKernel(net, prior_precision=1.3, prior_structure="network", space="function")
    x = torch.randn(4, 3, dtype=torch.float64)
    old = copy.deepcopy(net)
    labels = {n: 0 for n, _ in net.named_parameters()}
    tensor = kernel(x)
    net[1].running_var.mul_(3.0)  # a buffer
    net[3].weight.requires_grad_(False)  # the trainable set
    torch.testing.assert_close(tensor.to_dense(), brute_gram(old, x, x, torch.tensor([1.3], dtype=torch.float64), labels), **TOL)
    net[3].weight.requires_grad_(True)

    frozen = mlp(d_in=3, width=4, d_out=1, seed=4)
    frozen[0].weight.requires_grad_(False)
    kernel = NTKKernel(frozen, space="function")
    tensor = kernel(x)
    frozen[0].weight.data.add_(0.1)
    with pytest.raises(RuntimeError, match="frozen parameter changed"):
        tensor.to_dense()


def test_one_evidence_step_between_a_prior_and_its_read():
    """The train-mode output of an ``ExactNTKGP`` (its prior, a lazy NTK tensor) read after one Adam step of the
    exact marginal likelihood is the prior at the old δ."""
    net = mlp(d_in=3, width=6, d_out=1, seed=5)
    torch.manual_seed(6)
    x = torch.randn(10, 3, dtype=torch.float64)
    y = torch.sin(x.sum(-1))
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=DELTA, space="function").train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    prior = model(x)
    loss = -mll(model(x), y)
    loss.backward()
    opt.step()
    assert not torch.allclose(model.covar_module.prior_precision.detach(), DELTA)
    torch.testing.assert_close(prior.covariance_matrix, brute_gram(net, x, x, DELTA, LAYERS), **TOL)
