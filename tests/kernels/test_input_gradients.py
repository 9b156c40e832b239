"""Gradients of NTKKernel outputs with respect to the inputs, against central finite differences in float64.

For a fixed random weighting ``R`` the scalar ``s(x) = Σ R ⊙ K`` (or ``Σ r ⊙ diag K``) is differentiated by
autograd and compared with ``(s(x + εv) − s(x − εv)) / 2ε`` along random directions ``v``.
"""

import pytest
import torch

from ntkgp import NTKKernel
from tests.helpers import mlp, small_cnn

D64 = torch.float64
EPS = 1e-5


def directional_check(fn, x, directions=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(xg), xg)
    for _ in range(directions):
        v = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        with torch.no_grad():
            fd = (fn(x + EPS * v) - fn(x - EPS * v)) / (2 * EPS)
        auto = (grad * v).sum()
        assert abs(auto - fd) < 1e-6 * max(1.0, abs(fd)), (auto.item(), fd.item())


def cases():
    return [
        pytest.param(lambda: (mlp(d_out=1), None, torch.randn(5, 3, dtype=D64)), id="mlp-C1"),
        pytest.param(lambda: (mlp(d_out=3), None, torch.randn(5, 3, dtype=D64)), id="mlp-C3"),
        pytest.param(lambda: (small_cnn(c_out=2), (1, 6, 6), torch.randn(3, 36, dtype=D64)), id="cnn-C2"),
    ]


@pytest.mark.parametrize("make", cases())
@pytest.mark.parametrize("strategy", ["auto", "contraction"])
@pytest.mark.parametrize("space", ["function", "weight"])
def test_kernel_input_gradients_match_finite_differences(make, strategy, space):
    torch.manual_seed(1)
    net, input_shape, x = make()
    kernel = NTKKernel(
        net,
        prior_precision=torch.tensor([0.5, 2.0, 3.0], dtype=D64),
        input_shape=input_shape,
        strategy=strategy,
        space=space,
    )
    x2 = torch.randn_like(x)
    kernel(x).to_dense()  # fill the cache with a no-grad result: it must not be served below
    n, c = x.shape[0], kernel.num_outputs_per_input(x, x)
    r_sq = torch.randn(n * c, n * c, dtype=D64)
    r_cross = torch.randn(n * c, n * c, dtype=D64)
    r_diag = torch.randn(n * c, dtype=D64)
    directional_check(lambda z: (kernel(z).to_dense() * r_sq).sum(), x)  # K(x, x), both arguments
    directional_check(lambda z: (kernel(z, x2).to_dense() * r_cross).sum(), x)  # K(x, x2), first argument
    directional_check(lambda z: (kernel(x2, z).to_dense() * r_cross).sum(), x)  # second argument
    directional_check(lambda z: (kernel(z, diag=True) * r_diag).sum(), x)


def test_batched_input_gradients_match_finite_differences():
    net = mlp(d_out=2)
    kernel = NTKKernel(net, prior_precision=torch.tensor([0.5, 2.0, 3.0], dtype=D64))
    x = torch.randn(2, 4, 3, dtype=D64)
    train = torch.randn(6, 3, dtype=D64)
    r = torch.randn(2, 8, 12, dtype=D64)
    directional_check(lambda z: (kernel(z, train.expand(2, 6, 3)).to_dense() * r).sum(), x)
    directional_check(lambda z: kernel(z).to_dense().square().sum(), x)


@pytest.mark.parametrize("c", [1, 3])
def test_gradient_of_a_plain_exact_gp_prediction(c):
    """d/dx of (mean + variance) of an ordinary GPyTorch ExactGP with the NTK, test inputs ``(b, q, d)``."""
    from tests.kernels.test_batching import plain_exact_gp

    net = mlp(d_out=c)
    x, y = torch.randn(12, 3, dtype=D64), torch.randn(12, c, dtype=D64).squeeze(-1)
    model = plain_exact_gp(net, x, y, c)

    def objective(z):
        out = model(z)
        return (out.mean + out.variance).sum()

    directional_check(objective, torch.randn(2, 3, 3, dtype=D64))
