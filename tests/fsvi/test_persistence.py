"""FSVI's state: a conditioned model's observations travel with ``state_dict`` (a reload predicts as the saved
model and as the dense posterior), whole models pickle and ``torch.save`` (trained, conditioned, with observations
that carry a graph), and an interrupted ``train_fsvi`` leaves the user's network, likelihood and tensors as they
were (``.grad`` included) and lets the ``KeyboardInterrupt`` through."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from gpytorch.likelihoods import GaussianLikelihood

from ntkgp.fsvi import FSVI, FSVIOptimization, SamplerContext, train_fsvi

from . import reference as ref
from .test_conditioning import _check, _data, _dense_posterior, _likelihood, _model
from .test_model import _perturbed

F64 = torch.float64


def _fresh(c, seed=7):
    """An FSVI of the same architecture, built from other weights (the state replaces μ, s and the noise)."""
    return FSVI(ref.mlp(d_in=2, width=5, d_out=c, seed=seed), _likelihood(c)).eval()


def _same_predictions(a, b, x):
    with torch.no_grad():
        da, db = a(x), b(x)
        torch.testing.assert_close(db.mean, da.mean, rtol=0, atol=0)
        torch.testing.assert_close(db.covariance_matrix, da.covariance_matrix, rtol=0, atol=0)
        mc = [m.predict(x, method="mc", num_samples=5, generator=torch.Generator().manual_seed(4)) for m in (a, b)]
    torch.testing.assert_close(mc[1].mean, mc[0].mean, rtol=0, atol=0)


def _saved(obj, weights_only):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


@pytest.mark.parametrize("c", [1, 3])
def test_a_reloaded_conditioned_model_predicts_as_the_saved_one(c):
    net, model = _model(c)
    x_obs, y_obs = _data(4, c)
    conditioned = model.condition_on(x_obs, y_obs)
    fresh = _fresh(c)
    assert fresh.observations is None
    fresh.load_state_dict(_saved(conditioned.state_dict(), weights_only=True))
    torch.testing.assert_close(fresh.observations[0], x_obs, rtol=0, atol=0)
    x = torch.randn(5, 2, dtype=F64)
    _same_predictions(conditioned, fresh, x)
    with torch.no_grad():
        _check(fresh(x), *_dense_posterior(net, model, x, x_obs, y_obs))  # against dense Jacobians


def test_the_state_of_an_unconditioned_model_makes_a_conditioned_one_forget():
    _, model = _model(1)
    conditioned = model.condition_on(*_data(4, 1))
    conditioned.load_state_dict(model.state_dict())
    assert conditioned.observations is None
    _same_predictions(model, conditioned, torch.randn(3, 2, dtype=F64))


def test_images_reload_with_their_input_shape():
    net = ref.small_cnn(1)
    lik = GaussianLikelihood().double()
    model = _perturbed(FSVI(net, lik, init_std=0.05)).eval()
    x_obs = torch.randn(3, 1, 6, 6, dtype=F64)
    conditioned = model.condition_on(x_obs, torch.randn(3, dtype=F64))  # fixes input_shape (1, 6, 6)
    fresh = FSVI(ref.small_cnn(1), GaussianLikelihood().double(), init_std=0.05).eval()
    assert fresh.linearized.input_shape is None
    fresh.load_state_dict(conditioned.state_dict())
    assert fresh.linearized.input_shape == (1, 6, 6)
    _same_predictions(conditioned, fresh, torch.randn(2, 36, dtype=F64))  # flat inputs: the shape is known


def test_a_state_that_does_not_fit_is_refused_before_anything_changes():
    _, model = _model(1)
    conditioned = model.condition_on(*_data(4, 1))
    target = _fresh(1).condition_on(*_data(2, 1, seed=9))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    bad_values = {"observed_y": lambda s: s["observed_y"].fill_(float("nan")),
                  "observed_x": lambda s: s.__setitem__("observed_x", s["observed_x"][:, :1]),
                  "input_shape": lambda s: s.__setitem__("input_shape", torch.tensor([3, 1]))}
    for name, corrupt in bad_values.items():
        state = {k: v.clone() for k, v in conditioned.state_dict().items()}
        corrupt(state)
        target.linearized.input_shape = (2,) if name == "input_shape" else None
        with pytest.raises(ValueError, match="observations in the state|input_shape"):
            target.load_state_dict(state)
        for k, v in target.state_dict().items():
            if k != "input_shape":
                assert torch.equal(v, before[k]), (name, k)
    target.linearized.input_shape = None
    state = conditioned.state_dict()
    del state["observed_x"]
    with pytest.raises(RuntimeError, match="observed_x"):  # strict: torch names the missing key
        target.load_state_dict(state)


def test_a_state_of_another_network_or_with_a_key_missing_changes_nothing():
    """torch's ``load_state_dict`` copies every tensor that fits before it raises about the others: the state of a
    wider network's FSVI left this model with that model's last bias and noise (its mean moved by 0.25), a state
    without ``observed_x`` with all of the other model's parameters. Both are refused before anything is copied."""
    _, model = _model(1)
    target = _fresh(1).condition_on(*_data(2, 1, seed=9))
    x = _data(5, 1, seed=11)[0]
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with torch.no_grad():
        mean = target(x).mean

    def unchanged():
        for k, v in target.state_dict().items():
            assert torch.equal(v, before[k]), k
        with torch.no_grad():
            torch.testing.assert_close(target(x).mean, mean, rtol=0, atol=0)

    wider = FSVI(ref.mlp(d_in=2, width=7, d_out=1, seed=3), _likelihood(1))
    wider.likelihood.noise = 0.3
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"size mismatch for variational_distribution\.mean\.0"):
            target.load_state_dict(wider.state_dict(), strict=strict)
        unchanged()
    state = model.condition_on(*_data(3, 1)).state_dict()
    del state["observed_x"]
    with pytest.raises(RuntimeError, match="observed_x"):
        target.load_state_dict(state)
    unchanged()
    with pytest.raises(RuntimeError, match="unexpected.key"):
        target.load_state_dict({**model.state_dict(), "unexpected.key": torch.zeros(1)})
    unchanged()


def test_pickle_and_torch_save_of_trained_and_conditioned_models():
    x, y = _data(12, 1)
    result = train_fsvi(ref.mlp(d_in=2, width=5), x, y, _likelihood(1), epochs=2, batch_size=6, num_context=4,
                        progress=False)
    trained = result.model
    conditioned = trained.condition_on(*_data(3, 1, seed=5))
    x_graph = torch.randn(2, 2, dtype=F64, requires_grad=True)
    with_graph = trained.condition_on(2 * x_graph, torch.randn(2, dtype=F64))  # the observations hold a graph
    test_x = torch.randn(4, 2, dtype=F64)
    for model in (trained, conditioned, with_graph):
        for back in (pickle.loads(pickle.dumps(model)), _saved(model, weights_only=False), copy.deepcopy(model)):
            _same_predictions(model, back, test_x)
    assert x_graph.grad is None
    pickle.loads(pickle.dumps(result))  # FSVIResult too


def _interrupting_optimizer(at_step):
    class Interrupting(torch.optim.Adam):
        steps = 0

        def step(self, closure=None):
            Interrupting.steps += 1
            if Interrupting.steps == at_step:
                raise KeyboardInterrupt
            return super().step(closure)

    return Interrupting


@pytest.mark.parametrize("where", ["optimizer", "context"])
def test_an_interrupted_train_fsvi_leaves_everything_as_it_was(where):
    net = ref.mlp(d_in=2, width=5)
    net[0].weight.grad = torch.full_like(net[0].weight, 0.5)  # a gradient the user had: kept as is
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = _data(12, 1)
    x.requires_grad_(True)
    y.requires_grad_(True)
    x0, y0 = x.detach().clone(), y.detach().clone()
    lik = _likelihood(1)
    lik_state = {k: v.clone() for k, v in lik.state_dict().items()}
    calls = []

    def sampler(k, generator):
        calls.append(k)
        if len(calls) == 4:  # the first call is train_fsvi's check of one context point
            raise KeyboardInterrupt
        return torch.rand(k, 2, generator=generator, dtype=F64)

    options = {"optimizer": _interrupting_optimizer(3)} if where == "optimizer" else {"context": SamplerContext(sampler)}
    with pytest.raises(KeyboardInterrupt):
        train_fsvi(net, x, y, lik, epochs=3, batch_size=4, num_context=4,
                   optimization=FSVIOptimization(learn_likelihood=True), progress=False,
                   **options)
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    assert torch.equal(net[0].weight.grad, torch.full_like(net[0].weight, 0.5))
    assert all(p.grad is None for n, p in net.named_parameters() if n != "0.weight")
    assert sum(len(m._forward_hooks) for m in net.modules()) == 0
    assert torch.equal(x.detach(), x0) and torch.equal(y.detach(), y0)
    assert x.grad is None and y.grad is None
    assert all(torch.equal(v, lik_state[k]) for k, v in lik.state_dict().items())
    assert all(p.grad is None for p in lik.parameters())


def test_training_never_writes_the_gradients_of_the_user_tensors():
    x, y = _data(10, 1)
    x.requires_grad_(True)
    y.requires_grad_(True)
    context = torch.randn(8, 2, dtype=F64, requires_grad=True)
    result = train_fsvi(ref.mlp(d_in=2, width=5), x, y, _likelihood(1), epochs=2, batch_size=5, num_context=4,
                        context=context, progress=False)
    assert x.grad is None and y.grad is None and context.grad is None
    reference = train_fsvi(ref.mlp(d_in=2, width=5), x.detach(), y.detach(), _likelihood(1), epochs=2, batch_size=5,
                           num_context=4, context=context.detach(), progress=False)
    for a, b in zip(result.model.state_dict().values(), reference.model.state_dict().values()):
        assert torch.equal(a, b)  # the same training as on detached copies
