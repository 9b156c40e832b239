"""Algorithm 1 (online evidence optimisation) and model selection by evidence."""

import copy
import dataclasses
import math

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.datasets import gap_regression
from ntkgp.training import compare_models, HyperparameterSchedule, MAPOptimization, train_marglik
from tests.helpers import mlp


def regression_problem(seed=0):
    data = gap_regression(n=80, seed=seed, noise_std=0.1)
    net = mlp(d_in=1, width=20, d_out=1, depth=1, seed=seed)
    return data, net, gpytorch.likelihoods.GaussianLikelihood().double()


def test_algorithm1_raises_evidence_and_recovers_noise():
    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, epochs=400, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=50, frequency=50, hyper_steps=50),
                           progress=False)
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
                           schedule=HyperparameterSchedule(burn_in=20, frequency=50, hyper_steps=30),
                           progress=False)
    assert len(result.history) == 2 and all(torch.isfinite(torch.tensor(h["log_evidence"])) for h in result.history)
    assert result.history[-1]["log_evidence"] > result.history[0]["log_evidence"]


def test_classification_with_softmax():
    torch.manual_seed(0)
    x = torch.randn(60, 2, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    net = mlp(d_in=2, width=12, d_out=3, depth=1)
    lik = ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3).double()
    result = train_marglik(net, x, y, lik, epochs=100, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=20, frequency=40, hyper_steps=20),
                           progress=False)
    assert result.history[-1]["log_evidence"] > result.history[0]["log_evidence"]


def test_model_selection_table():
    data, net1, lik1 = regression_problem()
    net2 = mlp(d_in=1, width=20, d_out=1, depth=2, seed=0)
    lik2 = gpytorch.likelihoods.GaussianLikelihood().double()
    r1 = train_marglik(net1, data.x_train, data.y_train, lik1, epochs=200, lr=1e-2,
                       schedule=HyperparameterSchedule(burn_in=50, frequency=50, hyper_steps=30),
                       progress=False)
    r2 = train_marglik(net2, data.x_train, data.y_train, lik2, epochs=200, lr=1e-2,
                       schedule=HyperparameterSchedule(burn_in=50, frequency=50, hyper_steps=30),
                       progress=False)
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


def test_nan_in_any_row_is_caught_before_training():
    data, net, lik = regression_problem()
    x = data.x_train.clone()
    x[5, 0] = float("nan")
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ValueError, match="train_x contains NaN or Inf"):
        train_marglik(net, x, data.y_train, lik, epochs=5, progress=False)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize(
    ("argument", "value"),
    [("batch_size", 0), ("epochs", 0), ("frequency", 0), ("hyper_steps", -1), ("burn_in", -1), ("lr", 0.0),
     ("hyper_lr", float("inf")), ("curvature_batch_size", 0), ("batch_size", 2.5), ("epochs", True)],
)
def test_bad_numbers_are_named_before_training(argument, value):
    data, net, lik = regression_problem()
    before = copy.deepcopy(net.state_dict())
    grouped = {f.name for f in dataclasses.fields(HyperparameterSchedule)}
    settings = {"schedule": HyperparameterSchedule(**{argument: value})} if argument in grouped else {argument: value}
    with pytest.raises(ValueError, match=argument):
        train_marglik(net, data.x_train, data.y_train, lik, progress=False, **settings)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_numpy_numbers_are_numbers(small_regression):
    """``epochs=np.int64(6)`` (a count computed with numpy) was refused as "not an integer", as were numpy
    batch sizes, seeds and float32 learning rates; they give the run of the Python numbers."""
    np = pytest.importorskip("numpy")
    x, y, net, lik = small_regression(n=20)
    net_ref, lik_ref = copy.deepcopy(net), copy.deepcopy(lik)
    rounds = {"burn_in": 0, "frequency": 2, "hyper_steps": 3}
    result = train_marglik(net, x, y, lik, epochs=np.int64(4), batch_size=np.int32(10),
                           optimization=MAPOptimization(seed=np.int64(1)),
                           schedule=HyperparameterSchedule(hyper_lr=np.float64(0.1),
                                                           curvature_batch_size=np.int64(8), **rounds),
                           lr=np.float32(0.5) / 50, progress=False)
    reference = train_marglik(net_ref, x, y, lik_ref, epochs=4, batch_size=10,
                              optimization=MAPOptimization(seed=1),
                              schedule=HyperparameterSchedule(hyper_lr=0.1, curvature_batch_size=8, **rounds),
                              lr=float(np.float32(0.5) / 50), progress=False)
    assert result.log_evidence == reference.log_evidence
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), net_ref.state_dict().values()))
    with pytest.raises(ValueError, match="epochs"):
        train_marglik(net, x, y, lik, epochs=np.bool_(True), progress=False)


def test_a_huge_hyper_lr_cannot_run_away_silently():
    from ntkgp.training import HyperparameterWarning
    from ntkgp.training.safeguards import PRIOR_PRECISION_RANGE

    data, net, lik = regression_problem()
    with pytest.warns(HyperparameterWarning, match="hyper_lr"):
        result = train_marglik(net, data.x_train, data.y_train, lik, epochs=60, lr=1e-2,
                               schedule=HyperparameterSchedule(burn_in=20, frequency=20, hyper_steps=30,
                                                               hyper_lr=100.0),
                               progress=False)
    low, high = PRIOR_PRECISION_RANGE
    assert ((result.prior_precision >= low) & (result.prior_precision <= high)).all()
    assert torch.isfinite(torch.tensor(result.log_evidence))
    assert all(torch.isfinite(p).all() for p in net.parameters())
    model = result.model(data.x_train, data.y_train)
    assert abs(model.log_marginal_likelihood().item() / 80 - result.log_evidence) < 1e-8


def test_full_empirical_fisher_structure():
    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, structure="full_ef", epochs=120, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=20, frequency=50, hyper_steps=30),
                           progress=False)
    assert len(result.history) == 2 and result.history[-1]["log_evidence"] > result.history[0]["log_evidence"]
    model = result.model(data.x_train, data.y_train)
    assert abs(model.log_marginal_likelihood(curvature="ef").item() / 80 - result.log_evidence) < 1e-8


def test_removed_names_are_gone():
    """0.1.0 keeps no deprecated names: ``groups=`` is an unknown keyword, ``training.STRUCTURES`` and the
    ``training.weight_space`` aliases are gone (the structures are ``ntkgp.options.Structure``)."""
    data, net, lik = regression_problem()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(TypeError, match="groups"):
        train_marglik(net, data.x_train, data.y_train, lik, groups="network", epochs=3, progress=False)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    with pytest.raises(ImportError):
        from ntkgp.training import STRUCTURES  # noqa: F401
    with pytest.raises(ImportError):
        import ntkgp.training.weight_space  # noqa: F401


def test_history_noise_is_the_variance():
    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, epochs=30,
                           schedule=HyperparameterSchedule(burn_in=10, frequency=20, hyper_steps=5),
                           progress=False)
    assert result.history[-1]["noise"] == [pytest.approx(lik.noise.item())]  # σ², not σ


def test_compare_models_checks_its_arguments():
    data, net, lik = regression_problem()
    model = ntkgp.NTKGP(net, data.x_train, data.y_train, lik)
    with pytest.raises(TypeError, match="mapping"):
        compare_models([model])
    with pytest.raises(TypeError, match="names"):
        compare_models({1: model})
    with pytest.raises(ValueError, match="curvature"):
        compare_models({"a": model}, curvature="hessian")
    other = ntkgp.NTKGP(net, data.x_train, data.y_train + 1.0, lik)
    with pytest.raises(ValueError, match="targets"):
        compare_models({"a": model, "b": other})


@pytest.mark.parametrize(("batch_size", "steps_per_epoch"), [(None, 1), (32, 3)])
def test_batch_size_none_is_the_full_batch(batch_size, steps_per_epoch):
    """docs/training.md: batch_size=None takes one optimizer step per epoch (all N = 80 points)."""
    data, net, lik = regression_problem()
    steps = []

    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            steps.append(1)
            return super().step(closure)

    train_marglik(net, data.x_train, data.y_train, lik, epochs=2, batch_size=batch_size,
                  schedule=HyperparameterSchedule(burn_in=5, frequency=5, hyper_steps=0),
                  optimization=MAPOptimization(optimizer=Counting),
                  lr=1e-3, progress=False)
    assert len(steps) == 2 * steps_per_epoch


@pytest.mark.parametrize("structure", ["kfac", "diag_ggn", "full_ef"])
def test_result_posterior_is_the_structure_that_was_trained(structure):
    """result.posterior gives the weight-space posterior whose log-determinant is the training evidence's."""
    from ntkgp.laplace.weight_space import compute_curvature
    from ntkgp.laplace.ggn.full_curvature import full_ef

    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, structure=structure, epochs=40, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=20, frequency=20, hyper_steps=5),
                           progress=False)
    assert result.structure == structure
    posterior = result.posterior(data.x_train, data.y_train)
    assert posterior.structure == structure
    if structure == "full_ef":
        curvature = full_ef(net, data.x_train, data.y_train, lik)
    else:
        curvature = compute_curvature(net, data.x_train, data.y_train, lik, structure=structure)
    expected = curvature.log_det(result.prior_precision, lik)
    assert posterior.log_det_precision().item() == pytest.approx(expected.item(), rel=1e-9)
    prediction = ntkgp.laplace.predict(posterior, data.x_test[:5])
    assert torch.isfinite(prediction.f.variance).all() and (prediction.f.variance > 0).all()


def test_paper_protocol_one_step_per_epoch_records_exact_triples():
    """F = 1, K = 1, B = 0: each round's evidence is the one evaluated at the recorded hyperparameters."""
    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, epochs=6, lr=1e-3,
                           schedule=HyperparameterSchedule(hyper_lr=1e-3, burn_in=0, frequency=1,
                                                           hyper_steps=1),
                           progress=False)
    assert [h["epoch"] for h in result.history] == [1, 2, 3, 4, 5, 6]
    # the loaded checkpoint: network, δ and σ² together give the recorded evidence (independent NTKGP evidence)
    model = result.model(data.x_train, data.y_train)
    assert abs(model.log_marginal_likelihood().item() / 80 - result.log_evidence) < 1e-9
    best = next(h for h in result.history if h["epoch"] == result.best_epoch)
    assert best["prior_precision"] == pytest.approx(result.prior_precision.tolist(), rel=1e-12)
    assert best["noise"] == [pytest.approx(lik.noise.item(), rel=1e-12)]


@pytest.mark.parametrize("prior_structure", ["layer", "network"])
def test_the_curvature_is_built_once_per_round_not_per_step(monkeypatch, prior_structure):
    import ntkgp.training.hyper_round as module

    calls = []
    original = module.exact_curvature

    def counting(*args, **kwargs):
        curvature = original(*args, **kwargs)
        calls.append(curvature)
        return curvature

    monkeypatch.setattr(module, "exact_curvature", counting)
    data, net, lik = regression_problem()
    result = train_marglik(net, data.x_train, data.y_train, lik, prior_structure=prior_structure, epochs=40, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=0, frequency=20, hyper_steps=6),
                           progress=False)
    assert len(result.history) == 2 and len(calls) == 2  # two rounds (epochs 20 and 40), six steps each
    # P = 61 < N = 80: the weight space; one δ: the spectral form (one eigendecomposition per round)
    assert all(c.structure == "full_ggn" and c.num_params == 61 for c in calls)
    assert all(c.spectral == (prior_structure == "network") for c in calls)


@pytest.mark.parametrize("hyper_steps", [1, 10])
def test_a_round_of_few_steps_takes_the_space_of_the_cheaper_build(monkeypatch, hyper_steps):
    """N = 30 between ``WEIGHT_SPACE_FROM`` · P and P = 33: one step per build takes function space (the cheaper
    build), ten steps the weight space of ``choose_space``; the curvature's evidence equals the other space's at the
    same θ."""
    import ntkgp.training.hyper_round as module
    from ntkgp.laplace.weight_space import FullCurvature, FunctionSpaceCurvature
    from ntkgp.options import WEIGHT_SPACE_FROM

    calls = []
    original = module.exact_curvature

    def counting(*args, **kwargs):
        calls.append((args, kwargs, original(*args, **kwargs)))
        return calls[-1][2]

    monkeypatch.setattr(module, "exact_curvature", counting)
    torch.manual_seed(0)
    x = torch.randn(30, 2, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(30, dtype=torch.float64)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    assert WEIGHT_SPACE_FROM * 33 < 30 < 33
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    train_marglik(net, x, y, lik, epochs=2, lr=1e-2,
                  schedule=HyperparameterSchedule(burn_in=0, frequency=1, hyper_steps=hyper_steps),
                  progress=False)
    args, kwargs, curvature = calls[-1]
    assert isinstance(curvature, FunctionSpaceCurvature if hyper_steps == 1 else FullCurvature)
    other = original(*args, **{**kwargs, "space": "weight" if hyper_steps == 1 else "function"})
    delta = torch.tensor([0.7, 3.0], dtype=torch.float64)
    ours, theirs = curvature.log_marginal_likelihood(delta, lik), other.log_marginal_likelihood(delta, lik)
    assert abs(ours.item() - theirs.item()) < 1e-10 * abs(theirs.item())


def _diverging_problem():
    torch.manual_seed(0)
    x = torch.randn(30, 2, dtype=torch.float64)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(30, dtype=torch.float64)
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).double()
    return net, x, y


def test_diverging_map_training_stops_at_the_best_checkpoint():
    """SGD with a too large step: the round of epoch 5 has a finite evidence, then the weights blow up. Training
    stops with a warning and the epoch-5 checkpoint is loaded (finite weights), not a crash with NaN weights."""
    from ntkgp.training import HyperparameterWarning

    net, x, y = _diverging_problem()
    with pytest.warns(HyperparameterWarning, match="MAP training diverged"):
        result = train_marglik(net, x, y, gpytorch.likelihoods.GaussianLikelihood().double(), epochs=10, lr=1.2,
                               optimization=MAPOptimization(optimizer=torch.optim.SGD),
                               schedule=HyperparameterSchedule(burn_in=0, frequency=5, hyper_steps=20),
                               progress=False)
    assert result.best_epoch == 5 and math.isfinite(result.log_evidence)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert [r["epoch"] for r in result.history] == [5]


def test_diverging_before_any_round_restores_the_initial_weights_and_raises():
    net, x, y = _diverging_problem()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(FloatingPointError, match="initial weights are restored"):
        train_marglik(net, x, y, gpytorch.likelihoods.GaussianLikelihood().double(), epochs=10, lr=1e4,
                      optimization=MAPOptimization(optimizer=torch.optim.SGD),
                      schedule=HyperparameterSchedule(burn_in=0, frequency=5, hyper_steps=2), progress=False)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
