"""train_fsvi: the training loop, its inputs, and what FSVI does on two standard problems."""

from __future__ import annotations

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ntkgp import metrics
from ntkgp.datasets import gap_regression, two_moons
from ntkgp.fsvi import FSVI, FSVIOptimization, FSVIOptions, MonochromeContext, train_fsvi, UniformBoxContext
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood

from . import reference as ref


def _data(n=20, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=dtype) * 2 - 1
    return x, torch.sin(3 * x[:, :1]) + 0.1 * torch.randn(n, 1, generator=g, dtype=dtype)


def test_trains_without_touching_the_inputs():
    net = ref.mlp(d_in=2, width=8, d_out=1)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = _data()
    x0, y0 = x.clone(), y.clone()
    lik = GaussianLikelihood().double()
    noise = lik.noise.clone()
    res = train_fsvi(net, x, y, lik, epochs=3, batch_size=8, num_context=5,
                     optimization=FSVIOptimization(learn_likelihood=True), progress=False)
    assert len(res.history) == 3 and all(torch.isfinite(torch.tensor(h["elbo"])) for h in res.history)
    assert not res.model.training and isinstance(res.model, FSVI)
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k])
    assert sum(len(m._forward_hooks) for m in net.modules()) == 0
    assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(lik.noise, noise)
    assert not torch.equal(res.model.likelihood.noise, noise)  # the copy learned
    means = res.model.variational_distribution.means()
    assert not torch.equal(means["0.weight"], net[0].weight)  # μ moved, the network did not


def test_seeded():
    x, y = _data()
    runs = [train_fsvi(ref.mlp(d_in=2, width=6), x, y, GaussianLikelihood().double(), epochs=2, batch_size=7,
                       num_context=4, optimization=FSVIOptimization(seed=3),
                       progress=False) for _ in range(2)]
    for a, b in zip(runs[0].model.state_dict().values(), runs[1].model.state_dict().values()):
        assert torch.equal(a, b)


def test_data_loader_and_float32():
    x, y = _data(dtype=torch.float32)
    loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)
    net = ref.mlp(d_in=2, width=6, dtype=torch.float32)
    res = train_fsvi(net, loader, None, GaussianLikelihood(), epochs=2, num_context=4, progress=False,
                     context=UniformBoxContext(torch.full((2,), -2.0), torch.full((2,), 2.0)))
    assert len(res.history) == 2 and res.model.variational_distribution.mean[0].dtype == torch.float32
    with torch.no_grad():
        assert res.model(x).variance.dtype == torch.float32


def test_images_with_monochrome_context_mixed_with_the_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(12, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(3, (12,), generator=g)
    res = train_fsvi(ref.small_cnn(3), x, y, SoftmaxLikelihood(3).double(), epochs=2, batch_size=6, num_context=4,
                     optimization=FSVIOptimization(context_batch_fraction=0.5), progress=False)
    assert res.model.linearized.input_shape == (1, 6, 6)
    assert res.model.predict(x, num_samples=3).probs.shape == (12, 3)
    assert isinstance(MonochromeContext.from_data(x).sample(2), torch.Tensor)


def test_errors_name_the_argument():
    net = ref.mlp(d_in=2)
    x, y = _data()
    lik = GaussianLikelihood().double()
    cases = {
        "num_context": {"num_context": 0},
        "epochs": {"epochs": 0},
        "batch_size": {"batch_size": 0},
        "context_batch_fraction": {"optimization": FSVIOptimization(context_batch_fraction=2.0)},
        "lr": {"lr": -1.0},
        "context": {"context": "everywhere"},
        "context_jitter": {"options": FSVIOptions(context_jitter=-1.0)},
    }
    for name, kwargs in cases.items():
        with pytest.raises(ValueError, match=name):
            train_fsvi(net, x, y, lik, progress=False, **kwargs)
    with pytest.raises(ValueError, match="monochrome"):
        train_fsvi(net, x, y, lik, context="monochrome", progress=False)
    with pytest.raises(ValueError, match="train_y"):
        train_fsvi(net, x, y[:5], lik, progress=False)
    with pytest.raises(ValueError, match="outputs"):
        train_fsvi(ref.mlp(d_in=2, d_out=2), x, y, lik, epochs=1, progress=False)
    with pytest.raises(TypeError, match="likelihood"):
        train_fsvi(net, x, y, "gaussian", progress=False)


def _relu_net(d_in, width, seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1)).double()


@pytest.mark.slow
def test_gap_regression_in_between_uncertainty():
    """The predictive standard deviation in the middle of the gap is more than twice the one on the data.

    2×50 ReLU network, prior precisions 1 / fan-in per layer, 1000 full-batch steps, K = 32 context points
    uniform in the box of the inputs, near-exact KL (context_jitter=1e-6); measured ratio ≈ 4.
    """
    d = gap_regression(n=60, noise_std=0.1, seed=0)
    lik = GaussianLikelihood().double()
    lik.noise = 0.01
    res = train_fsvi(_relu_net(1, 50, 0), d.x_train, d.y_train, lik, prior_precision=torch.tensor([1.0, 50.0, 50.0]),
                     epochs=1000, batch_size=None, lr=1e-2, num_context=32,
                     options=FSVIOptions(context_jitter=1e-6), progress=False)
    x = torch.linspace(-1, 1, 41, dtype=torch.float64)[:, None]
    with torch.no_grad():
        std = res.model(x).variance.sqrt()
        mean = res.model(d.x_train).mean
    gap, on_data = x.abs().squeeze() < 0.2, ((x.abs() > 0.45) & (x.abs() < 0.9)).squeeze()
    assert metrics.rmse(mean, d.y_train) < 0.15  # it fits the data
    assert std[gap].mean() > 2 * std[on_data].mean()


@pytest.mark.slow
def test_two_moons_no_worse_than_map():
    """Test NLPD of FSVI (Monte Carlo predictive) ≤ MAP's + 0.01, same network, same prior, same steps.

    The tolerance covers the Monte Carlo error of the predictive (200 draws) and optimizer noise; over seeds 0–2
    FSVI was 0.01–0.03 below MAP (0.115).
    """
    x, y = two_moons(n=100, noise=0.2, seed=0)
    x_test, y_test = two_moons(n=1000, noise=0.2, seed=100)
    net = _relu_net(2, 32, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(1000):  # MAP: negative log-likelihood + prior precision 1 on every weight
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(net(x).squeeze(-1), y.double(), reduction="sum")
        (loss + 0.5 * sum(p.square().sum() for p in net.parameters())).backward()
        opt.step()
    with torch.no_grad():
        nlpd_map = metrics.categorical_nlpd(torch.sigmoid(net(x_test)).squeeze(-1), y_test)
    res = train_fsvi(_relu_net(2, 32, 0), x, y, LogisticLikelihood().double(), prior_precision=1.0, epochs=1000,
                     batch_size=None, lr=1e-2, num_context=32, progress=False)
    with torch.no_grad():
        probs = res.model.predict(x_test, num_samples=200, generator=torch.Generator().manual_seed(0)).probs
    assert metrics.categorical_nlpd(probs, y_test) <= nlpd_map + 0.01


def test_inputs_context_and_loaders_that_cannot_work_raise_before_training():
    """Inputs or context points that do not fit the network, NaN in any row, a one-shot iterator of batches (read
    once by the setup, none left to train on) and a non-callable optimizer: errors naming the argument, and the
    network untouched."""
    x, y = _data()
    net = ref.mlp(d_in=2, width=4, d_out=1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    lik = GaussianLikelihood().double()
    cases = [
        (dict(train_x=torch.randn(20, 3, dtype=torch.float64)), ValueError, "train_x of shape"),
        (dict(context=torch.randn(10, 5, dtype=torch.float64)), ValueError, "context of shape"),
        (dict(train_x=torch.cat([x[:-1], torch.full((1, 2), float("nan"), dtype=torch.float64)])), ValueError,
         "train_x contains NaN"),
        (dict(optimization=FSVIOptimization(optimizer="adam")), TypeError, "optimizer must be"),
        (dict(train_x=((x[i : i + 5], y[i : i + 5]) for i in range(0, 20, 5)), train_y=None), TypeError,
         "re-iterable"),
    ]
    for change, kind, message in cases:
        kwargs = dict(train_x=x, train_y=y, epochs=1, num_context=4, progress=False) | change
        with pytest.raises(kind, match=message):
            train_fsvi(net, likelihood=lik, **kwargs)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_arrays_and_batches_that_are_not_tensors_are_type_errors_naming_train_x():
    """A numpy ``train_x`` with ``train_y`` was read as a loader ("train_y must be None when train_x is a loader");
    without ``train_y`` its rows were taken for batches. A list of numpy batches reached a raw error."""
    x, y = _data()
    net = ref.mlp(d_in=2, width=4, d_out=1)
    lik = GaussianLikelihood().double()
    for train_x, train_y in [(x.numpy(), y), (x.numpy(), None), (x.tolist(), y), ([(x.numpy(), y.numpy())], None),
                             ([x], None), ([(x, y, y)], None)]:
        with pytest.raises(TypeError, match="train_x"):
            train_fsvi(net, train_x, train_y, lik, epochs=1, num_context=4, progress=False)


def test_a_numpy_seed_is_a_seed():
    """``seed=np.int64(0)`` was refused as "not an integer"; it gives the run of ``seed=0``."""
    np = pytest.importorskip("numpy")
    x, y = _data()
    runs = [train_fsvi(ref.mlp(d_in=2, width=4, d_out=1), x, y, GaussianLikelihood().double(), epochs=2,
                       num_context=4, optimization=FSVIOptimization(seed=seed),
                       progress=False).model for seed in (np.int64(3), 3)]
    with torch.no_grad():
        torch.testing.assert_close(runs[0](x).mean, runs[1](x).mean, rtol=0, atol=0)
    with pytest.raises(TypeError, match="seed"):
        train_fsvi(ref.mlp(d_in=2), x, y, GaussianLikelihood().double(),
                   optimization=FSVIOptimization(seed=2.0), progress=False)


def test_a_likelihood_with_another_number_of_outputs_is_refused_by_the_model():
    net = ref.mlp(d_in=2, width=4, d_out=2)
    model = FSVI(net, GaussianLikelihood().double())
    x = torch.randn(5, 2, dtype=torch.float64)
    for call in (lambda: model(x), lambda: model.predict(x), lambda: model.function_space_kl(x)):
        with pytest.raises(ValueError, match="net has 2 outputs but the likelihood GaussianLikelihood expects 1"):
            call()
