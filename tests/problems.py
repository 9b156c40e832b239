"""Small problems shared by the evidence, MLL and NTKGP tests: a small MLP, inputs, targets, a
likelihood and the reference log-density of each kind."""

import gpytorch
import torch

from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from tests.helpers import mlp, reference_log_prob


def make_problem(kind: str, n: int = 12, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(n, 3, dtype=torch.float64)
    if kind == "regression1":
        net, lik = mlp(d_out=1, seed=seed), gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.3
        y = torch.randn(n, dtype=torch.float64)
        log_prob = lambda f, yy: reference_log_prob("gaussian", f, yy, lik.noise.detach())
    elif kind == "regression2":
        net = mlp(d_out=2, seed=seed)
        lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False).double()
        lik.task_noises = torch.tensor([0.2, 0.5], dtype=torch.float64)
        y = torch.randn(n, 2, dtype=torch.float64)
        log_prob = lambda f, yy: reference_log_prob("gaussian", f, yy, lik.task_noises.detach())
    elif kind == "binary":
        net, lik = mlp(d_out=1, seed=seed), LogisticLikelihood(temperature=0.7).double()
        y = (torch.rand(n) > 0.5).double()
        temperature = float(lik.temperature)  # 0.7 as stored (its raw value was set in float32)
        log_prob = lambda f, yy: reference_log_prob("logistic", f, yy, temperature=temperature)
    else:
        net, lik = mlp(d_out=4, seed=seed), SoftmaxLikelihood(num_classes=4).double()
        y = torch.randint(0, 4, (n,))
        temperature = float(lik.temperature)  # 1 as stored
        log_prob = lambda f, yy: reference_log_prob("softmax", f, yy, temperature=temperature)
    return net, x, y, lik, log_prob


KINDS = ["regression1", "regression2", "binary", "softmax4"]


LEARNABLE_KINDS = ["regression1", "regression_global_noise", "binary", "softmax3"]


def learnable_problem(kind: str, n: int = 12, seed: int = 0, dtype=torch.float64):
    """A small problem whose likelihood hyperparameter is learnable (noise or temperature)."""
    torch.manual_seed(seed)
    x = torch.randn(n, 3, dtype=dtype)
    if kind == "regression1":
        net, lik = mlp(d_out=1, seed=seed, dtype=dtype), gpytorch.likelihoods.GaussianLikelihood().to(dtype)
        lik.noise = 0.3
        y = torch.randn(n, dtype=dtype)
    elif kind == "regression_global_noise":
        net = mlp(d_out=2, seed=seed, dtype=dtype)
        lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_task_noise=False).to(
            dtype
        )
        lik.noise = 0.2
        y = torch.randn(n, 2, dtype=dtype)
    elif kind == "binary":
        net, lik = (
            mlp(d_out=1, seed=seed, dtype=dtype),
            LogisticLikelihood(temperature=0.7, learn_temperature=True),
        )
        lik = lik.to(dtype)
        y = (torch.rand(n) > 0.5).to(dtype)
    else:
        net, lik = (
            mlp(d_out=3, seed=seed, dtype=dtype),
            SoftmaxLikelihood(3, temperature=1.3, learn_temperature=True),
        )
        lik = lik.to(dtype)
        y = torch.randint(0, 3, (n,))
    return net, x, y, lik
