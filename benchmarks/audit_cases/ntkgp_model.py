"""Audit cases of ``ntkgp.NTKGP``: inputs, state changes, persistence, interrupts (against dense float64)."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import torch
from torch import nn

import ntkgp
from ntkgp.likelihoods import LogisticLikelihood

from .framework import (CLEAR, HELD, Interrupter, Refused, SilentWrong, attempt, case, close,
                        expect_interrupt, refusal, untouched)
from .references import F64, binary, fit, gaussian, glm_predictive, mlp, regression

AREA = "ntkgp"
TOL = 1e-7


def _setup(noise: float = 0.1, delta: float = 1.0, dtype=F64, net=None):
    x, y = regression(20, dtype=dtype)
    net = net if net is not None else fit(mlp(dtype=dtype), x, y)
    x_test = torch.linspace(-2.5, 2.5, 7, dtype=dtype)[:, None]
    return net, x, y, x_test, gaussian(noise, dtype)


def _predict(model, x_test):
    with torch.no_grad():
        pred = model(x_test)
        return pred.mean, pred.variance


def _against_reference(model, net, x, y, x_test, delta=1.0, noise=0.1, what="", mean="gp"):
    m, v = _predict(model, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, delta, noise, mean=mean)
    close(m, ref_m, TOL, what=f"{what} mean".strip())
    close(v, ref_v, TOL, rtol=1e-6, what=f"{what} variance".strip())


@case("ntkgp-01", AREA, "model(x) with x a numpy array")
def numpy_test_inputs():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: model(x_test.numpy()), names=("x", "X"))


@case("ntkgp-02", AREA, "train_x a non-contiguous view (every other column of a wider tensor)")
def noncontiguous_train_x():
    net, x, y, x_test, lik = _setup()
    wide = torch.stack([x[:, 0], torch.full_like(x[:, 0], 9.0)], dim=1)
    view = wide[:, :1]
    assert not view.is_contiguous() or view.stride() != (1, 1)
    with untouched(net=net, train_x=wide):
        model = ntkgp.NTKGP(net, view, y, lik).eval()
        _against_reference(model, net, x, y, x_test)
    return HELD, "equals the dense reference"


@case("ntkgp-03", AREA, "test inputs an expanded tensor (stride 0: one point repeated)")
def expanded_test_inputs():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    point = torch.tensor([[0.3]], dtype=F64)
    expanded = point.expand(5, 1)
    with untouched(net=net, point=point):
        m, v = _predict(model, expanded)
    ref_m, ref_v = glm_predictive(net, x, y, point, 1.0, 0.1)
    close(m, ref_m.expand(5), TOL, what="mean")
    close(v, ref_v.expand(5), TOL, what="variance")
    return HELD, "five equal rows, equal to the reference"


@case("ntkgp-04", AREA, "integer (int64) regression targets with a GaussianLikelihood")
def integer_regression_targets():
    net, x, _, x_test, lik = _setup()
    y_int = torch.arange(20) % 3 - 1
    with untouched(net=net, train_y=y_int):
        built = attempt(lambda: ntkgp.NTKGP(net, x, y_int, lik).eval(), names=("train_y",))
    if isinstance(built, Refused):
        return CLEAR, str(built)
    _against_reference(built, net, x, y_int.to(F64), x_test)
    return HELD, "the same as float targets (dense reference)"


@case("ntkgp-05", AREA, "model(x) with x on the meta device")
def meta_test_inputs():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    with untouched(net=net):
        return refusal(lambda: _predict(model, x_test.to("meta")), names=("x", "X", "device", "meta"))


@case("ntkgp-06", AREA, "float32 training data with a float64 network (converted)")
def float32_data_float64_net():
    net, x, y, x_test, lik = _setup()
    x32, y32 = x.float(), y.float()
    with untouched(net=net, train_x=x32, train_y=y32):
        model = ntkgp.NTKGP(net, x32, y32, lik).eval()
        _against_reference(model, net, x32.double(), y32.double(), x_test)
    return HELD, "the float64 model of the float32 values"


@case("ntkgp-07", AREA, "network weights changed in place through .data after a prediction")
def weights_data_write():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    net[2].weight.data.mul_(1.7)
    net[0].bias.data.add_(0.3)
    _against_reference(model, net, x, y, x_test, what="after the change:")
    return HELD, "recomputed: equals the reference at the new weights"


@case("ntkgp-08", AREA, "likelihood.noise changed after a prediction")
def noise_changed():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    lik.noise = 0.02
    _against_reference(model, net, x, y, x_test, noise=0.02, what="after noise 0.1 -> 0.02:")
    return HELD, "recomputed"


@case("ntkgp-09", AREA, "net.train() after construction on a network with Dropout")
def dropout_switched_to_train():
    x, y = regression(20)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 1)).double().eval()
    fit(net, x, y)
    net.eval()
    x_test = torch.linspace(-2, 2, 5, dtype=F64)[:, None]
    model = ntkgp.NTKGP(net, x, y, gaussian()).eval()
    net.train()
    outcome = attempt(lambda: _predict(model, x_test), (ValueError, RuntimeError),
                      names=("train", "dropout", "Dropout", "random"))
    net.eval()
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    net.train()
    ref_m, ref_v = glm_predictive(net.eval(), x, y, x_test, 1.0, 0.1)
    close(outcome[0], ref_m, TOL, what="mean (network in train mode)")
    return HELD, "predicts as in eval mode"


@case("ntkgp-10", AREA, "requires_grad_(True) on a parameter that was frozen when the model was built")
def unfrozen_after_construction():
    net, x, y, x_test, lik = _setup()
    net[0].weight.requires_grad_(False)
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    net[0].weight.requires_grad_(True)
    outcome = attempt(lambda: _predict(model, x_test), (RuntimeError, ValueError),
                      names=("requires_grad", "frozen", "trainable", "parameters"))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, 0.1)  # all four tensors trainable now
    close(outcome[1], ref_v, TOL, rtol=1e-6, what="variance after unfreezing")
    return HELD, "picked up"


@case("ntkgp-11", AREA, "model.predictive_mean = 'bogus'")
def bad_predictive_mean_assignment():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    result = refusal(lambda: setattr(model, "predictive_mean", "bogus"), names=("predictive_mean",))
    _against_reference(model, net, x, y, x_test, what="after the refused assignment:")
    return result


@case("ntkgp-12", AREA, "state_dict (δ = 3, noise 0.05) loaded into a freshly built model")
def state_dict_round_trip():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    model.covar_module.prior_precision = 3.0
    lik.noise = 0.05
    _predict(model, x_test)
    fresh = ntkgp.NTKGP(net, x, y, gaussian(0.7)).eval()
    _predict(fresh, x_test)
    fresh.load_state_dict(model.state_dict())
    _against_reference(fresh, net, x, y, x_test, delta=3.0, noise=0.05, what="reloaded:")
    return HELD, "equals the reference at δ = 3, σ² = 0.05"


@case("ntkgp-13", AREA, "pickle of a used model (after predictions), loaded and predicting")
def pickle_used_model():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    with untouched(net=net):
        loaded = pickle.loads(pickle.dumps(model))
    _against_reference(loaded, net, x, y, x_test, what="unpickled:")
    return HELD, "equal predictions"


@case("ntkgp-14", AREA, "deepcopy of a used model, then the original network's weights changed")
def deepcopy_then_change():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, 0.1)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        net[2].weight.mul_(2.0)
    m, v = _predict(clone, x_test)
    if clone.net is net:  # shares the network: must follow it
        ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, 0.1)
    close(m, ref_m, TOL, what="mean of the copy")
    close(v, ref_v, TOL, rtol=1e-6, what="variance of the copy")
    return HELD, "the copy keeps its own network" if clone.net is not net else "shares the network"


@case("ntkgp-15", AREA, "KeyboardInterrupt from a forward hook in the first prediction, then predict again")
def interrupt_first_prediction():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    hook = Interrupter(net, at=1)
    try:
        expect_interrupt(lambda: _predict(model, x_test))
    finally:
        hook.remove()
    _against_reference(model, net, x, y, x_test, what="after the interrupt:")
    return HELD, "no half-filled cache"


@case("ntkgp-16", AREA, "backward of the predictive variance w.r.t. inputs: network .grad untouched")
def input_gradients_leave_net_grad():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    net[0].weight.grad = torch.full_like(net[0].weight, 5.0)
    xt = x_test.clone().requires_grad_(True)
    with untouched(net=net, likelihood=lik):
        pred = model(xt)
        (pred.variance.sum() + pred.mean.sum()).backward()
    if xt.grad is None or not torch.isfinite(xt.grad).all():
        raise SilentWrong("no finite input gradient")
    return HELD, "only x.grad written"


@case("ntkgp-17", AREA, "condition_on(x_new a transposed view, y_new int64) against the model on the union")
def condition_on_views():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    x_new = torch.tensor([[0.1, 1.1, 2.1]], dtype=F64).t()  # (3, 1), non-contiguous
    y_new = torch.tensor([0, 1, 1])
    with untouched(net=net, x_new=x_new, y_new=y_new):
        outcome = attempt(lambda: model.condition_on(x_new, y_new), names=("y_new",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    _against_reference(outcome.eval(), net, torch.cat([x, x_new]), torch.cat([y, y_new.to(F64)]), x_test,
                       what="conditioned:")
    return HELD, "equals the dense model on the union"


@case("ntkgp-18", AREA, "prior_precision set to NaN through the setter")
def nan_prior_precision_setter():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    result = refusal(lambda: setattr(model.covar_module, "prior_precision", torch.tensor(float("nan"))),
                     names=("prior_precision",))
    _against_reference(model, net, x, y, x_test, what="after the refused setter:")
    return result


@case("ntkgp-19", AREA, "torch.save / torch.load of a used model")
def torch_save_used_model():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _against_reference(loaded, loaded.net, x, y, x_test, what="loaded:")
    return HELD, "equal predictions"


@case("ntkgp-20", AREA, "model.double() on a float32 model: the user's float32 network stays float32")
def double_of_float32_model():
    net, x, y, x_test, lik = _setup(dtype=torch.float32)
    model = ntkgp.NTKGP(net, x, y, lik)
    with untouched(net=net):
        model = model.double().eval()
        m, v = _predict(model, x_test.double())
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, 0.1)
    close(m, ref_m, 2e-3, what="mean")
    close(v, ref_v, 2e-3, rtol=1e-2, what="variance")
    return HELD, "network untouched, values within float32 error"


@case("ntkgp-21", AREA, "KeyboardInterrupt during condition_on, then the original model predicts")
def interrupt_condition_on():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    x_new = torch.tensor([[0.5], [1.5]], dtype=F64)
    hook = Interrupter(net, at=1)
    try:
        expect_interrupt(lambda: model.condition_on(x_new, torch.zeros(2, dtype=F64)))
    finally:
        hook.remove()
    _against_reference(model, net, x, y, x_test, what="original after the interrupt:")
    return HELD, "unchanged"


@case("ntkgp-22", AREA, "LogisticLikelihood with bool labels (against float 0/1 labels, dense)")
def bool_labels():
    x, y = binary(30)
    net = fit(mlp(2, 8, 1), x, y, loss="bce")
    labels = y.bool()
    x_test = torch.randn(6, 2, dtype=F64, generator=torch.Generator().manual_seed(3))
    with untouched(net=net, train_y=labels):
        built = attempt(lambda: ntkgp.NTKGP(net, x, labels, LogisticLikelihood().double()).eval(),
                        names=("train_y",))
    if isinstance(built, Refused):
        return CLEAR, str(built)
    m, v = _predict(built, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, None)
    close(m, ref_m, TOL, what="mean")
    close(v, ref_v, TOL, rtol=1e-6, what="variance")
    return HELD, "as float labels"


@case("ntkgp-23", AREA, "prior_precision given as a numpy float64 array of one value per layer")
def numpy_prior_precision():
    net, x, y, x_test, lik = _setup()
    delta = np.array([2.0, 2.0])
    built = attempt(lambda: ntkgp.NTKGP(net, x, y, lik, prior_precision=delta).eval(),
                    names=("prior_precision",))
    if isinstance(built, Refused):
        return CLEAR, str(built)
    _against_reference(built, net, x, y, x_test, delta=2.0)
    return HELD, "accepted, equal to the reference at δ = 2"


@case("ntkgp-24", AREA, "prediction_chunk_size=np.int64(3) (a numpy integer) against 3")
def numpy_chunk_size():
    net, x, y, x_test, lik = _setup()
    try:
        model = ntkgp.NTKGP(net, x, y, lik, prediction_chunk_size=np.int64(3)).eval()
    except (TypeError, ValueError) as error:
        raise RuntimeError(f"a valid integer refused: {type(error).__name__}: {error}") from error
    _against_reference(model, net, x, y, x_test)
    return HELD, "accepted"


@case("ntkgp-25", AREA, "load_state_dict from a model with another prior_structure (4 groups into 2)")
def load_state_dict_other_structure():
    net, x, y, x_test, lik = _setup()
    other_lik = gaussian(0.5)
    other = ntkgp.NTKGP(net, x, y, other_lik, prior_structure="parameter", prior_precision=5.0)
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    result = refusal(lambda: model.load_state_dict(other.state_dict()), (RuntimeError, ValueError),
                     names=("prior_precision", "size", "shape"))
    _against_reference(model, net, x, y, x_test, what="refused, but partly loaded:")
    return result


@case("ntkgp-26", AREA, "KeyboardInterrupt from the likelihood (its noise) in the first prediction, then again")
def interrupt_in_likelihood():
    from .references import InterruptingGaussian, interrupting_gaussian

    net, x, y, x_test, _ = _setup()
    lik = interrupting_gaussian(0.1)
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    InterruptingGaussian.arm(1)
    try:
        expect_interrupt(lambda: _predict(model, x_test))
    finally:
        InterruptingGaussian.disarm()
    _against_reference(model, net, x, y, x_test, what="after the interrupt:")
    return HELD, "no half-filled cache"


@case("ntkgp-27", AREA, "model.predictive_mean = 'nn' after a prediction, then train() / eval() switched")
def predictive_mean_assigned():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    _predict(model, x_test)
    model.predictive_mean = "nn"
    model.train()
    model.eval()
    _against_reference(model, net, x, y, x_test, what="predictive_mean='nn':", mean="nn")
    return HELD, "the network's output with the GLM covariance"
