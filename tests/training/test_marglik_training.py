"""Algorithm 1 (online evidence optimisation) and model selection by evidence."""

import copy

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.datasets import gap_regression
from ntkgp.training import compare_models, train_marglik
from tests.helpers import mlp


def regression_problem(seed=0):
    data = gap_regression(n=80, seed=seed, noise_std=0.1)
    net = mlp(d_in=1, width=20, d_out=1, depth=1, seed=seed)
    return data, net, gpytorch.likelihoods.GaussianLikelihood().double()


def test_algorithm1_raises_evidence_and_recovers_noise():
    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, epochs=400, lr=1e-2, burn_in=50, frequency=50,
                           hyper_steps=50, progress=False)
    evidences = [h["log_evidence"] for h in result.history]
    assert len(evidences) == 7  # epochs 100, 150, ..., 400
    assert max(evidences) > evidences[0] + 0.1
    assert result.log_evidence == max(evidences)
    assert abs(lik.noise.sqrt().item() - data.noise_std) / data.noise_std < 0.25
    # the best checkpoint is loaded: its evidence, recomputed independently, is the reported one
    model = result.model(data.x_train, data.y_train)
    assert abs(model.log_marginal_likelihood().item() / 80 - result.log_evidence) < 1e-8


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn", "diag_ef"])
def test_scalable_structures_run_and_learn(structure):
    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, structure=structure, epochs=120, lr=1e-2,
                           burn_in=20, frequency=50, hyper_steps=30, progress=False)
    assert len(result.history) == 2 and all(torch.isfinite(torch.tensor(h["log_evidence"])) for h in result.history)
    assert result.history[-1]["log_evidence"] > result.history[0]["log_evidence"]


def test_classification_with_softmax():
    torch.manual_seed(0)
    x = torch.randn(60, 2, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    net = mlp(d_in=2, width=12, d_out=3, depth=1)
    lik = ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3).double()
    result = train_marglik(net, x, y, lik, epochs=100, lr=1e-2, burn_in=20, frequency=40, hyper_steps=20, progress=False)
    assert result.history[-1]["log_evidence"] > result.history[0]["log_evidence"]


def test_model_selection_table():
    data, net1, lik1 = regression_problem()
    net2 = mlp(d_in=1, width=20, d_out=1, depth=2, seed=0)
    lik2 = gpytorch.likelihoods.GaussianLikelihood().double()
    r1 = train_marglik(net1, data.x_train, data.y_train, lik1, epochs=200, lr=1e-2, burn_in=50, frequency=50,
                       hyper_steps=30, progress=False)
    r2 = train_marglik(net2, data.x_train, data.y_train, lik2, epochs=200, lr=1e-2, burn_in=50, frequency=50,
                       hyper_steps=30, progress=False)
    m1, m2 = r1.model(data.x_train, data.y_train), r2.model(data.x_train, data.y_train)
    table = compare_models({"shallow": m1, "deep": m2})
    assert [r.log_evidence_per_n for r in table] == sorted([r.log_evidence_per_n for r in table], reverse=True)
    by_name = {r.name: r for r in table}
    assert abs(by_name["shallow"].log_evidence_per_n - m1.log_marginal_likelihood().item() / 80) < 1e-10
    assert by_name["deep"].num_params == sum(p.numel() for p in net2.parameters())
    assert "log evidence/N" in str(table)
    with pytest.raises(ValueError, match="share the training data"):
        compare_models({"a": m1, "b": r2.model(data.x_train[:40], data.y_train[:40])})


def test_bad_arguments():
    data, net, lik = regression_problem()
    with pytest.raises(ValueError, match="structure"):
        train_marglik(net, data.x_train, data.y_train, lik, structure="dense", progress=False)
    with pytest.raises(ValueError, match="train_y"):
        train_marglik(net, data.x_train, data.y_train[:10], lik, progress=False)
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match="outputs"):
        train_marglik(net, data.x_train, data.y_train, ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3), progress=False)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
