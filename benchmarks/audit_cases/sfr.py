"""Audit cases of ``ntkgp.SFR``: inputs, state changes, persistence and interrupts.

With the inducing inputs equal to the training inputs SFR is the GLM predictive (docs/sfr.md), so the values
are checked against the dense float64 GLM predictive; elsewhere against a freshly built SFR.
"""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import torch

import ntkgp

from .framework import (CLEAR, HELD, Interrupter, Refused, SilentWrong, attempt, case, close,
                        expect_interrupt, refusal, untouched)
from .references import F64, fit, gaussian, glm_predictive, mlp, regression
from ntkgp.models import SFRMemoryOptions

AREA = "sfr"
TOL = 1e-7


def _setup(dtype=F64, noise: float = 0.1):
    x, y = regression(20, dtype=dtype)
    net = fit(mlp(dtype=dtype), x, y)
    return net, x, y, torch.linspace(-2.5, 2.5, 7, dtype=dtype)[:, None], gaussian(noise, dtype)


def _predict(model, x_test):
    with torch.no_grad():
        pred = model(x_test)
        return pred.mean, pred.variance


def _same_as(model, reference_model, x_test, what="", tol=TOL):
    m, v = _predict(model, x_test)
    ref_m, ref_v = _predict(reference_model, x_test)
    close(m, ref_m, tol, what=f"{what} mean".strip())
    close(v, ref_v, tol, rtol=1e-6, what=f"{what} variance".strip())


def _dense(model, net, x, y, x_test, delta=1.0, noise=0.1, what="", mean="gp"):
    m, v = _predict(model, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, delta, noise, mean=mean)
    close(m, ref_m, 1e-6, what=f"{what} mean".strip())
    close(v, ref_v, 1e-6, rtol=1e-5, what=f"{what} variance".strip())


@case("sfr-01", AREA, "inducing_points given as a numpy array")
def numpy_inducing_points():
    net, x, y, x_test, lik = _setup()
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: ntkgp.SFR(net, x, y, lik, inducing_points=x.numpy()),
                       names=("inducing_points",))


@case("sfr-02", AREA, "inducing_points a non-contiguous view equal to train_x (Z = X: the dense GLM)")
def noncontiguous_inducing_points():
    net, x, y, x_test, lik = _setup()
    wide = torch.cat([x, -x], dim=1)
    z = wide[:, :1]
    with untouched(net=net, inducing_points=wide):
        model = ntkgp.SFR(net, x, y, lik, inducing_points=z)
    _dense(model, net, x, y, x_test)
    return HELD, "equals the dense GLM predictive"


@case("sfr-03", AREA, "the user's inducing_points tensor written in place after construction")
def inducing_points_written_afterwards():
    net, x, y, x_test, lik = _setup()
    z = x[:10].clone()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=z)
    before = _predict(model, x_test)
    z.mul_(3.0)
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="mean after the user's write")
    close(after[1], before[1], 0.0, what="variance after the user's write")
    return HELD, "the model holds its own copy of Z"


@case("sfr-04", AREA, "integer (int64) regression targets with a GaussianLikelihood")
def integer_targets():
    net, x, _, x_test, lik = _setup()
    y_int = torch.arange(20) % 3 - 1
    with untouched(net=net, train_y=y_int):
        built = attempt(lambda: ntkgp.SFR(net, x, y_int, lik, inducing_points=x), names=("train_y",))
    if isinstance(built, Refused):
        return CLEAR, str(built)
    fresh = ntkgp.SFR(net, x, y_int.to(F64), gaussian(), inducing_points=x)
    _same_as(built, fresh, x_test, "against float targets:", tol=1e-12)
    return HELD, "the same as float targets"


@case("sfr-05", AREA, "likelihood.noise changed after a prediction (Z = X)")
def noise_changed():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    _predict(model, x_test)
    lik.noise = 0.03
    _dense(model, net, x, y, x_test, noise=0.03, what="after noise 0.1 -> 0.03:")
    return HELD, "re-weighted statistics equal the dense GLM"


@case("sfr-06", AREA, "prior_precision changed with .data on the raw parameter after a prediction (Z = X)")
def prior_precision_data_write():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    _predict(model, x_test)
    raw = model.covar_module.raw_prior_precision
    target = model.covar_module.raw_prior_precision_constraint.inverse_transform(torch.full_like(raw, 4.0))
    raw.data.copy_(target)
    _dense(model, net, x, y, x_test, delta=4.0, what="after δ 1 -> 4:")
    return HELD, "equals the dense GLM at δ = 4"


@case("sfr-07", AREA, "network weights moved by an optimizer step, then restored")
def weights_moved_then_restored():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    before = _predict(model, x_test)
    saved = copy.deepcopy(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(x).sum().backward()
    opt.step()
    result = refusal(lambda: _predict(model, x_test), (RuntimeError,), names=("weights", "changed"))
    net.load_state_dict(saved)
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="mean after restoring")
    return result


@case("sfr-08", AREA, "requires_grad_(False) on a parameter after the SFR was built")
def frozen_after_construction():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    _predict(model, x_test)
    net[0].weight.requires_grad_(False)
    outcome = attempt(lambda: _predict(model, x_test), (RuntimeError, ValueError),
                      names=("requires_grad", "frozen", "trainable", "parameters"))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    fresh = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    m, v = _predict(fresh, x_test)
    close(outcome[1], v, TOL, rtol=1e-6, what="variance against a fresh SFR with the frozen parameter")
    close(outcome[0], m, TOL, what="mean against a fresh SFR")
    return HELD, "picked up"


@case("sfr-09", AREA, "sfr.predictive_mean = 'nn' assigned after construction")
def predictive_mean_assigned():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    _predict(model, x_test)
    outcome = attempt(lambda: setattr(model, "predictive_mean", "nn"),
                      (ValueError, TypeError, AttributeError), names=("predictive_mean",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    fresh = ntkgp.SFR(net, x, y, lik, inducing_points=x, predictive_mean="nn")
    _same_as(model, fresh, x_test, "against a fresh SFR(predictive_mean='nn'):")
    return HELD, "equals a fresh model"


@case("sfr-10", AREA, "state_dict of an updated SFR loaded into a fresh SFR on the original data")
def state_dict_after_update():
    net, x, y, x_test, lik = _setup()
    z = x[:12].clone()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=z)
    x_new, y_new = regression(6, seed=5)
    model.update(x_new, y_new)
    fresh = ntkgp.SFR(net, x, y, gaussian(), inducing_points=z)
    before = _predict(fresh, x_test)
    fresh.load_state_dict(model.state_dict())
    _same_as(fresh, model, x_test, "reloaded against the saved model:", tol=1e-12)
    if torch.equal(_predict(fresh, x_test)[1], before[1]):
        raise SilentWrong("the reloaded model predicts as before loading")
    return HELD, "the reloaded model includes the update"


@case("sfr-11", AREA, "torch.save / torch.load of an SFR after update()")
def torch_save_after_update():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10)
    x_new, y_new = regression(6, seed=5)
    model.update(x_new, y_new)
    before = _predict(model, x_test)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    after = _predict(loaded, x_test)
    close(after[0], before[0], 1e-12, what="mean of the loaded model")
    close(after[1], before[1], 1e-12, what="variance of the loaded model")
    return HELD, "equal predictions"


@case("sfr-12", AREA, "deepcopy of a used SFR, then the copy updated: the original is unchanged")
def deepcopy_then_update():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10)
    before = _predict(model, x_test)
    with untouched(net=net, likelihood=lik):
        clone = copy.deepcopy(model)
        x_new, y_new = regression(6, seed=5)
        clone.update(x_new, y_new)
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="the original's mean")
    moved = _predict(clone, x_test)
    if torch.equal(moved[1], before[1]):
        raise SilentWrong("the copy's update changed nothing")
    return HELD, "independent copies"


@case("sfr-13", AREA, "KeyboardInterrupt in the second batch of update(loader): the model is unchanged")
def interrupt_update_loader():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10)
    before = _predict(model, x_test)
    x_new, y_new = regression(8, seed=5)
    batches = [(x_new[:4], y_new[:4]), (x_new[4:], y_new[4:])]
    untouched_copy = copy.deepcopy(model)
    with untouched(net=net):
        hook = Interrupter(net, at=2)
        try:
            expect_interrupt(lambda: model.update(batches, None))
        finally:
            hook.remove()
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="mean after the interrupted update")
    close(after[1], before[1], 0.0, what="variance after the interrupted update")
    model.update(batches, None)
    untouched_copy.update(batches, None)
    _same_as(model, untouched_copy, x_test, "update after the interrupt vs an uninterrupted copy:", tol=1e-12)
    return HELD, "unchanged, and a later update equals an uninterrupted one"


@case("sfr-14", AREA, "KeyboardInterrupt during construction: no hook left on the network")
def interrupt_construction():
    net, x, y, x_test, lik = _setup()
    with untouched(net=net, likelihood=lik):
        hook = Interrupter(net, at=2)
        try:
            expect_interrupt(lambda: ntkgp.SFR(net, x, y, lik, num_inducing=10))
        finally:
            hook.remove()
    return HELD, "propagated, network as before"


@case("sfr-15", AREA, "update(loader) whose second batch has a NaN target: refused, model unchanged")
def nan_in_second_update_batch():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10)
    before = _predict(model, x_test)
    x_new, y_new = regression(8, seed=5)
    y_bad = y_new.clone()
    y_bad[6] = float("nan")
    result = refusal(lambda: model.update([(x_new[:4], y_bad[:4]), (x_new[4:], y_bad[4:])], None),
                     names=("y_new", "y", "target"))
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="mean after the refused update")
    return result


@case("sfr-16", AREA, "sfr(x) with float32 test inputs on a float64 model")
def float32_test_inputs():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    x32 = x_test.float()
    with untouched(x=x32):
        outcome = attempt(lambda: _predict(model, x32), names=("x",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    ref = _predict(model, x32.double())
    close(outcome[0], ref[0], 1e-12, what="mean")
    return HELD, "converted"


@case("sfr-17", AREA, "load_state_dict of an SFR with another number of inducing points")
def load_state_dict_other_m():
    net, x, y, x_test, lik = _setup()
    small = ntkgp.SFR(net, x, y, gaussian(), num_inducing=5)
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10)
    before = _predict(model, x_test)
    result = refusal(lambda: model.load_state_dict(small.state_dict()), (RuntimeError, ValueError),
                     names=("inducing", "size", "shape"))
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="mean after the refused load")
    close(after[1], before[1], 0.0, what="variance after the refused load")
    return result


@case("sfr-18", AREA, "sfr.train() then sfr(x): the train-mode predictive equals the eval-mode one")
def train_mode_prediction():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10)
    before = _predict(model, x_test)
    model.train()
    with untouched(net=net):
        during = _predict(model, x_test)
    model.eval()
    close(during[0], before[0], 1e-10, what="train-mode mean")
    close(during[1], before[1], 1e-10, rtol=1e-8, what="train-mode variance")
    return HELD, "equal"


@case("sfr-19", AREA, "update with zero new points")
def empty_update():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10)
    before = _predict(model, x_test)
    outcome = attempt(lambda: model.update(x[:0], y[:0]), names=("x_new",))
    after = _predict(model, x_test)
    close(after[0], before[0], 0.0, what="mean after an empty update")
    return (CLEAR, str(outcome)) if isinstance(outcome, Refused) else (HELD, "a no-op")


@case("sfr-20", AREA, "pickle of a never-used SFR with statistics='combined', loaded, then both predict")
def pickle_combined():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=10, memory=SFRMemoryOptions(statistics="combined"))
    loaded = pickle.loads(pickle.dumps(model))
    before = _predict(model, x_test)
    after = _predict(loaded, x_test)
    close(after[0], before[0], 1e-12, what="mean of the unpickled model")
    close(after[1], before[1], 1e-12, what="variance of the unpickled model")
    return HELD, "equal predictions"


@case("sfr-21", AREA, "prior_precision given as a numpy array")
def numpy_prior_precision():
    net, x, y, x_test, lik = _setup()
    delta = np.array([2.0, 2.0])
    outcome = attempt(lambda: ntkgp.SFR(net, x, y, lik, inducing_points=x, prior_precision=delta),
                      names=("prior_precision",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    _dense(outcome, net, x, y, x_test, delta=2.0)
    return HELD, "equals the dense GLM at δ = 2"


@case("sfr-22", AREA, "KeyboardInterrupt from the likelihood (its noise) in the first prediction, then again")
def interrupt_prediction_likelihood():
    from .references import InterruptingGaussian, interrupting_gaussian

    net, x, y, x_test, _ = _setup()
    model = ntkgp.SFR(net, x, y, interrupting_gaussian(0.1), inducing_points=x)
    InterruptingGaussian.arm(1)
    try:
        expect_interrupt(lambda: _predict(model, x_test))
    finally:
        InterruptingGaussian.disarm()
    _dense(model, net, x, y, x_test, what="after the interrupt:")
    return HELD, "no half-filled cache: the dense GLM"
