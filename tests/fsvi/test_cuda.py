"""FSVI on a CUDA device (skipped without one): same KL as on the CPU, training and prediction run there."""

from __future__ import annotations

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood

from ntkgp.fsvi import FSVI, train_fsvi
from ntkgp.likelihoods import SoftmaxLikelihood

from . import reference as ref

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("kl_covariance", ["full", "block", "diagonal"])
def test_kl_and_covariance_match_the_cpu(kl_covariance):
    cpu = FSVI(ref.small_cnn(3), SoftmaxLikelihood(3).double(), init_std=0.1, kl_covariance=kl_covariance)
    gpu = FSVI(ref.small_cnn(3).cuda(), SoftmaxLikelihood(3).double(), init_std=0.1,
               kl_covariance=kl_covariance).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(gpu.function_space_kl(x.cuda()).cpu(), cpu.function_space_kl(x), rtol=1e-8, atol=1e-8)
    with torch.no_grad():
        torch.testing.assert_close(gpu(x.cuda()).variance.cpu(), cpu(x).variance, rtol=1e-8, atol=1e-10)


def test_training_on_the_device():
    x = torch.rand(40, 2, device="cuda") * 2 - 1
    y = torch.sin(3 * x[:, :1])
    net = ref.mlp(d_in=2, width=16, dtype=torch.float32).cuda()
    res = train_fsvi(net, x, y, GaussianLikelihood(), epochs=3, batch_size=16, num_context=8, progress=False)
    assert res.model.variational_distribution.mean[0].is_cuda
    with torch.no_grad():
        pred = res.model.predict(x, num_samples=4)
    assert pred.mean.is_cuda and torch.isfinite(pred.variance).all()
