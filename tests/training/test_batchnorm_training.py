"""train_marglik on a network with BatchNorm: batch statistics for the MAP steps (running statistics updated with the
module's momentum), eval mode for the rounds and at the end — checked against one SGD step computed independently
on a copy of the network in training mode."""

import copy

import gpytorch
import pytest
import torch
from torch import nn

from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik


def network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double().eval()


def data():
    g = torch.Generator().manual_seed(1)
    x = 2.0 + torch.randn(32, 3, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(-1)) + 0.1 * torch.randn(32, generator=g, dtype=torch.float64)


def run(net, x, y, train_normalization=True):
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.1
    train_marglik(net, x, y, likelihood, epochs=1,
                  schedule=HyperparameterSchedule(burn_in=1, frequency=1, hyper_steps=1,
                                                  learn_likelihood=False),
                  optimization=MAPOptimization(optimizer=torch.optim.SGD,
                                               train_normalization=train_normalization),
                  lr=0.05, prior_precision=2.0, progress=False)
    return likelihood


def test_the_map_step_uses_batch_statistics_and_updates_the_running_ones():
    net, (x, y) = network(), data()
    reference = copy.deepcopy(net).train()
    # one full-batch SGD step on (½δ‖θ‖² − log p(y | f(x; θ)))/N, BatchNorm in training mode
    out = reference(x).squeeze(-1)
    noise = gpytorch.likelihoods.GaussianLikelihood().double()
    noise.noise = 0.1  # the value the likelihood holds after its constraint's round trip
    fit = torch.distributions.Normal(out, noise.noise.detach().squeeze().sqrt()).log_prob(y).sum()
    prior = 0.5 * 2.0 * sum(p.square().sum() for p in reference.parameters())
    grads = torch.autograd.grad((prior - fit) / 32, list(reference.parameters()))
    with torch.no_grad():
        expected = [p - 0.05 * g for p, g in zip(reference.parameters(), grads)]
    run(net, x, y)
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)
    # running statistics: (1 − momentum) · 0 + momentum · the batch mean of the BatchNorm's input
    torch.testing.assert_close(net[1].running_mean, reference[1].running_mean)
    assert net[1].running_mean.abs().max() > 0.01
    assert not net[1].training and not net.training  # eval mode again, as given


def test_train_normalization_false_keeps_the_running_statistics():
    net, (x, y) = network(), data()
    before = net[1].running_mean.clone(), net[1].running_var.clone()
    run(net, x, y, train_normalization=False)
    assert torch.equal(net[1].running_mean, before[0]) and torch.equal(net[1].running_var, before[1])


def test_train_normalization_is_checked_before_training():
    net, (x, y) = network(), data()
    state = copy.deepcopy(net.state_dict())
    with pytest.raises(TypeError, match="train_normalization"):
        run(net, x, y, train_normalization="yes")
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k])
