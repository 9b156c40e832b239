"""The same results on CUDA as on the CPU (skipped without a GPU; CI has none)."""

import copy

import gpytorch
import pytest
import torch

import ntkgp
from tests.helpers import mlp, rel_err

pytestmark = pytest.mark.cuda


def test_kernel_and_evidence_on_cuda_match_cpu():
    net = mlp(d_out=3)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    cpu = ntkgp.NTKGP(net, x, y, ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3).double())
    gpu_net = copy.deepcopy(net).cuda()
    gpu = ntkgp.NTKGP(gpu_net, x.cuda(), y.cuda(), ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3).double().cuda())
    assert gpu.covar_module.prior_precision.is_cuda
    assert rel_err(gpu.covar_module(x.cuda()).to_dense().cpu(), cpu.covar_module(x).to_dense()) < 1e-10
    assert rel_err(gpu.log_marginal_likelihood().detach().cpu(), cpu.log_marginal_likelihood().detach()) < 1e-10
    x_test = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        a, b = gpu.eval()(x_test.cuda()), cpu.eval()(x_test)
    assert rel_err(a.mean.cpu(), b.mean) < 1e-10 and rel_err(a.variance.cpu(), b.variance) < 1e-10


def test_sfr_on_cuda_matches_cpu():
    net = mlp(d_out=1)
    x = torch.randn(60, 3, dtype=torch.float64)
    y = torch.randn(60, dtype=torch.float64)
    cpu = ntkgp.SFR(net, x, y, gpytorch.likelihoods.GaussianLikelihood().double(), num_inducing=20)
    gpu = ntkgp.SFR(copy.deepcopy(net).cuda(), x.cuda(), y.cuda(),
                    gpytorch.likelihoods.GaussianLikelihood().double().cuda(), num_inducing=20)
    x_test = torch.randn(7, 3, dtype=torch.float64)
    with torch.no_grad():
        a, b = gpu(x_test.cuda()), cpu(x_test)
    assert rel_err(a.mean.cpu(), b.mean) < 1e-8 and rel_err(a.variance.cpu(), b.variance) < 1e-8
