"""Audit cases of ``ntkgp.fsvi`` (``FSVI``, ``train_fsvi``, ``condition_on``) against the dense linearized GP.

The reference: ``f(x; μ)`` and ``J_μ diag(s²) J_μᵀ`` from ``torch.func`` Jacobians of a copy of the network
holding μ, conditioned by the dense GP formulas (float64).
"""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch import nn

from ntkgp.fsvi import FSVI, train_fsvi

from .framework import (CLEAR, HELD, Interrupter, Refused, SilentWrong, attempt, case, close,
                        expect_interrupt, refusal, untouched)
from .references import (F64, InterruptingGaussian, fit, gaussian, interrupting_gaussian, mlp,
                         outputs_and_jacobian, regression)

AREA = "fsvi"
TOL = 1e-8


def _setup(dtype=F64, net=None, noise=0.05):
    x, y = regression(16, dtype=dtype)
    net = net if net is not None else fit(mlp(dtype=dtype), x, y, steps=60)
    model = FSVI(net, gaussian(noise, dtype), init_std=0.05)
    return net, x, y, torch.linspace(-2.5, 2.5, 6, dtype=dtype)[:, None], model


def _observations(dtype=F64):
    x_new = torch.tensor([[1.5], [1.8], [-0.4]], dtype=dtype)
    return x_new, torch.sin(2 * x_new[:, 0])


def _predict(model, x_test):
    with torch.no_grad():
        pred = model(x_test)
        return pred.mean, pred.variance


def dense(model, x_test, observed=None, noise=None):
    """The dense linearized GP of ``model`` (optionally conditioned on ``observed`` under ``noise``)."""
    net = copy.deepcopy(model.net).to(F64)
    means, variances = model.variational_distribution.means(), model.variational_distribution.variances()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name in means:
                p.copy_(means[name])
    s2 = torch.cat([variances[n].detach().reshape(-1).to(F64)
                    for n, p in net.named_parameters() if p.requires_grad])
    f_test, j_test = outputs_and_jacobian(net, x_test)
    mean, cov = f_test.reshape(-1), (j_test * s2) @ j_test.T
    if observed is not None:
        x_obs, y_obs = observed
        f_obs, j_obs = outputs_and_jacobian(net, x_obs)
        k_oo = (j_obs * s2) @ j_obs.T + noise * torch.eye(j_obs.shape[0], dtype=F64)
        k_to = (j_test * s2) @ j_obs.T
        mean = mean + k_to @ torch.linalg.solve(k_oo, y_obs.to(F64).reshape(-1) - f_obs.reshape(-1))
        cov = cov - k_to @ torch.linalg.solve(k_oo, k_to.T)
    return mean, cov.diagonal()


def _against_dense(model, x_test, observed=None, noise=None, what="", tol=TOL):
    m, v = _predict(model, x_test)
    ref_m, ref_v = dense(model, x_test, observed, noise)
    close(m, ref_m, tol, what=f"{what} mean".strip())
    close(v, ref_v, tol, rtol=1e-6, what=f"{what} variance".strip())


def _short_training(net, x, y, likelihood, **kwargs):
    options = {"epochs": 3, "batch_size": None, "lr": 1e-2, "num_context": 8, "progress": False, **kwargs}
    return train_fsvi(net, x, y, likelihood, **options)


@case("fsvi-01", AREA, "train_fsvi with train_x a numpy array")
def numpy_train_x():
    net, x, y, _, _ = _setup()
    lik = gaussian(0.05)
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: _short_training(net, x.numpy(), y, lik), (TypeError,), names=("train_x",))


@case("fsvi-02", AREA, "train_fsvi with int64 regression targets (against the same run on float targets)")
def integer_targets():
    net, x, _, x_test, _ = _setup()
    y_int = torch.arange(16) % 3 - 1
    with untouched(net=net, train_y=y_int):
        outcome = attempt(lambda: _short_training(net, x, y_int, gaussian(0.05)), names=("train_y",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    reference = _short_training(net, x, y_int.to(F64), gaussian(0.05))
    m, v = _predict(outcome.model, x_test)
    ref_m, ref_v = _predict(reference.model, x_test)
    close(m, ref_m, 1e-12, what="mean")
    close(v, ref_v, 1e-12, what="variance")
    return HELD, "the same model as with float targets"


@case("fsvi-03", AREA, "KeyboardInterrupt from the likelihood (its noise, 3rd read) during train_fsvi")
def interrupt_in_likelihood():
    net, x, y, _, _ = _setup()
    lik = interrupting_gaussian(0.05)
    net[0].weight.grad = torch.ones_like(net[0].weight)
    InterruptingGaussian.arm(3)
    try:
        with untouched(net=net, likelihood=lik, train_x=x, train_y=y):
            expect_interrupt(lambda: _short_training(net, x, y, lik, epochs=5))
    finally:
        InterruptingGaussian.disarm()
    return HELD, "propagated; network, likelihood and data as before"


class _InterruptingAdam(torch.optim.Adam):
    steps = 0

    def step(self, closure=None):
        type(self).steps += 1
        if type(self).steps == 2:
            raise KeyboardInterrupt
        return super().step(closure)


@case("fsvi-04", AREA, "KeyboardInterrupt from the optimizer's second step during train_fsvi")
def interrupt_in_optimizer():
    net, x, y, _, _ = _setup()
    lik = gaussian(0.05)
    lik.raw_noise.grad = torch.full_like(lik.raw_noise, 2.0)
    _InterruptingAdam.steps = 0
    with untouched(net=net, likelihood=lik, train_x=x, train_y=y):
        expect_interrupt(lambda: _short_training(net, x, y, lik, optimizer=_InterruptingAdam,
                                                 learn_likelihood=True))
    return HELD, "propagated; nothing of the user's changed"


@case("fsvi-05", AREA, "state_dict of a trained model loaded into a freshly built FSVI")
def state_dict_trained():
    net, x, y, x_test, _ = _setup()
    trained = _short_training(net, x, y, gaussian(0.05), init_std=0.05).model
    fresh = FSVI(net, gaussian(0.3), init_std=0.2)
    fresh.load_state_dict(trained.state_dict())
    m, v = _predict(fresh, x_test)
    ref = _predict(trained, x_test)
    close(m, ref[0], 1e-12, what="mean against the saved model")
    close(v, ref[1], 1e-12, what="variance against the saved model")
    _against_dense(fresh, x_test, what="reloaded against dense:")
    return HELD, "equal to the saved model and to the dense GP"


@case("fsvi-06", AREA, "torch.save / torch.load of a conditioned model")
def torch_save_conditioned():
    net, x, y, x_test, model = _setup()
    observed = _observations()
    conditioned = model.condition_on(*observed)
    buffer = io.BytesIO()
    torch.save(conditioned, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _against_dense(loaded, x_test, observed, 0.05, what="loaded conditioned model:")
    return HELD, "the dense conditioned GP"


@case("fsvi-07", AREA, "load_state_dict from an FSVI of a wider network")
def load_state_dict_other_network():
    net, x, y, x_test, model = _setup()
    other = FSVI(mlp(hidden=12), gaussian(0.05))
    before = _predict(model, x_test)
    result = refusal(lambda: model.load_state_dict(other.state_dict()), (RuntimeError, ValueError),
                     names=("size", "shape", "mean"))
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="refused, but partly loaded: mean after the refused load")
    close(after[1], before[1], 0.0, what="refused, but partly loaded: variance after the refused load")
    return result


@case("fsvi-08", AREA, "condition_on with int64 targets")
def condition_on_integer_targets():
    net, x, y, x_test, model = _setup()
    x_new = torch.tensor([[1.5], [1.8]], dtype=F64)
    y_new = torch.tensor([1, -1])
    with untouched(net=net, x_new=x_new, y_new=y_new):
        outcome = attempt(lambda: model.condition_on(x_new, y_new), names=("y_new",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    _against_dense(outcome, x_test, (x_new, y_new.to(F64)), 0.05, what="conditioned:")
    return HELD, "the dense conditioned GP"


@case("fsvi-09", AREA, "the user's x_new written in place after condition_on")
def x_new_written_afterwards():
    net, x, y, x_test, model = _setup()
    x_new, y_new = _observations()
    conditioned = model.condition_on(x_new, y_new)
    kept = x_new.clone()
    x_new.mul_(-2.0)
    _against_dense(conditioned, x_test, (kept, y_new), 0.05, what="after the user's write:")
    return HELD, "the model holds its own copy"


@case("fsvi-10", AREA, "the network's trainable weights changed after FSVI was built")
def network_weights_changed():
    net, x, y, x_test, model = _setup()
    before = _predict(model, x_test)
    with torch.no_grad():
        net[2].weight.mul_(3.0)
    after = _predict(model, x_test)
    close(after[0], before[0], 1e-12, what="mean (μ is the model's own copy)")
    close(after[1], before[1], 1e-12, what="variance")
    _against_dense(model, x_test, what="against dense at μ:")
    return HELD, "predictions follow μ, not the network"


@case("fsvi-11", AREA, "noise of a conditioned model's likelihood changed after a prediction")
def conditioned_noise_changed():
    net, x, y, x_test, model = _setup()
    observed = _observations()
    conditioned = model.condition_on(*observed)
    _predict(conditioned, x_test)
    conditioned.likelihood.noise = 0.2
    _against_dense(conditioned, x_test, observed, 0.2, what="after noise 0.05 -> 0.2:")
    return HELD, "refactorized"


@case("fsvi-12", AREA, "model(x) with x on the meta device")
def meta_inputs():
    net, x, y, x_test, model = _setup()
    with untouched(net=net):
        return refusal(lambda: _predict(model, x_test.to("meta")), names=("x", "device", "meta"))


@case("fsvi-13", AREA, "deepcopy of a conditioned model")
def deepcopy_conditioned():
    net, x, y, x_test, model = _setup()
    observed = _observations()
    conditioned = model.condition_on(*observed)
    _predict(conditioned, x_test)
    clone = copy.deepcopy(conditioned)
    if clone.net is not net:
        raise SilentWrong("the copy does not share the network (docs/fsvi.md: a deepcopy shares it)")
    _against_dense(clone, x_test, observed, 0.05, what="copy:")
    return HELD, "the dense conditioned GP, network shared"


@case("fsvi-14", AREA, "model.context_jitter = -1 assigned")
def negative_context_jitter():
    net, x, y, x_test, model = _setup()
    x_context = torch.linspace(-2, 2, 5, dtype=F64)[:, None]
    before = model.function_space_kl(x_context).item()
    result = refusal(lambda: setattr(model, "context_jitter", -1.0), names=("context_jitter",))
    after = model.function_space_kl(x_context).item()
    if before != after:
        raise SilentWrong(f"the KL changed after a refused assignment: {before} -> {after}")
    return result


@case("fsvi-15", AREA, "a float32 copy of the model against float64 (linearized predictive)")
def float32_against_float64():
    net, x, y, x_test, model = _setup()
    net32 = copy.deepcopy(net).float()
    model32 = FSVI(net32, gaussian(0.05, torch.float32), init_std=0.05)
    m, v = _predict(model32, x_test.float())
    ref_m, ref_v = _predict(model, x_test)
    close(m, ref_m, 1e-4, what="float32 mean")
    close(v, ref_v, 1e-6, rtol=1e-3, what="float32 variance")
    return HELD, "within float32 rounding"


@case("fsvi-16", AREA, "model.predict(x, num_samples=0)")
def zero_samples():
    net, x, y, x_test, model = _setup()
    return refusal(lambda: model.predict(x_test, num_samples=0), names=("num_samples",))


@case("fsvi-17", AREA, "function_space_kl with a NaN context point")
def nan_context():
    net, x, y, x_test, model = _setup()
    x_context = torch.linspace(-2, 2, 5, dtype=F64)[:, None]
    x_context[2, 0] = float("nan")
    return refusal(lambda: model.function_space_kl(x_context), names=("x_context", "context"))


@case("fsvi-18", AREA, "KeyboardInterrupt during condition_on, then condition_on again")
def interrupt_condition_on():
    net, x, y, x_test, model = _setup()
    observed = _observations()
    before = _predict(model, x_test)
    hook = Interrupter(net, at=1)
    try:
        outcome = expect_interrupt(lambda: _predict(model.condition_on(*observed), x_test))
    finally:
        hook.remove()
    del outcome
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="the original's mean")
    _against_dense(model.condition_on(*observed), x_test, observed, 0.05,
                   what="conditioned after the interrupt:")
    return HELD, "original unchanged, the next conditioning right"


@case("fsvi-19", AREA, "a BatchNorm running_mean written in place after conditioning (fixed buffers)")
def buffer_changed_after_conditioning():
    x, y = regression(16)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(1, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)).double()
    with torch.no_grad():
        net(x)
    net.eval()
    model = FSVI(net, gaussian(0.05), init_std=0.05)
    observed = _observations()
    conditioned = model.condition_on(*observed)
    x_test = torch.linspace(-2, 2, 5, dtype=F64)[:, None]
    _predict(conditioned, x_test)
    net[1].running_mean.add_(0.5)
    _against_dense(conditioned, x_test, observed, 0.05, what="after the buffer write:")
    return HELD, "recomputed at the new buffers"


@case("fsvi-20", AREA, "pickle of a model trained on a list of (x, y) batches")
def pickle_trained_on_batches():
    net, x, y, x_test, _ = _setup()
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]
    trained = train_fsvi(net, batches, None, gaussian(0.05), epochs=2, lr=1e-2, num_context=8,
                         progress=False).model
    loaded = pickle.loads(pickle.dumps(trained))
    m, v = _predict(loaded, x_test)
    ref = _predict(trained, x_test)
    close(m, ref[0], 1e-12, what="mean of the unpickled model")
    close(v, ref[1], 1e-12, what="variance of the unpickled model")
    return HELD, "equal predictions"


@case("fsvi-21", AREA, "train_fsvi(seed=np.int64(0)) (a numpy integer) against seed=0")
def numpy_seed():
    import numpy as np

    net, x, y, x_test, _ = _setup()
    try:
        outcome = _short_training(net, x, y, gaussian(0.05), seed=np.int64(0))
    except (TypeError, ValueError) as error:
        raise RuntimeError(f"a valid integer seed refused: {type(error).__name__}: {error}") from error
    reference = _short_training(net, x, y, gaussian(0.05), seed=0)
    m, v = _predict(outcome.model, x_test)
    ref_m, ref_v = _predict(reference.model, x_test)
    close(m, ref_m, 0.0, what="mean")
    close(v, ref_v, 0.0, what="variance")
    return HELD, "the same run"
