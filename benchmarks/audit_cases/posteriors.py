"""Audit cases of the weight-space posteriors (``ntkgp.laplace.laplace_posterior`` with every structure) and
``ntkgp.laplace.predict``, against dense float64 GGNs (full, diagonal, last layer) or a fresh posterior."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import torch

from ntkgp.laplace import laplace_posterior, predict

from .framework import (CLEAR, HELD, Interrupter, Refused, SilentWrong, attempt, case, close,
                        expect_interrupt, refusal, untouched)
from .references import F64, fit, gaussian, mlp, outputs_and_jacobian, regression, weight_space_variances

AREA = "posteriors"
NOISE = 0.1


def _setup(dtype=F64):
    x, y = regression(20, dtype=dtype)
    net = fit(mlp(dtype=dtype), x, y)
    return net, x, y, torch.linspace(-2.5, 2.5, 7, dtype=dtype)[:, None], gaussian(NOISE, dtype)


def _glm(posterior, x_test, **kwargs):
    prediction = predict(posterior, x_test, **kwargs)
    return prediction.f.mean, prediction.f.variance


def _against_dense(posterior, net, x, x_test, delta=1.0, noise=NOISE, names=None, diagonal=False, what=""):
    m, v = _glm(posterior, x_test)
    f_test, _ = outputs_and_jacobian(net, x_test)
    close(m, f_test.reshape(-1), 1e-10, what=f"{what} mean".strip())
    ref = weight_space_variances(net, x, x_test, noise, delta, names, diagonal)
    close(v, ref, 1e-9, rtol=1e-7, what=f"{what} variance".strip())


def _same(a, b, tol=0.0, what=""):
    close(a[0], b[0], tol, what=f"{what} mean".strip())
    close(a[1], b[1], tol, what=f"{what} variance".strip())


@case("posteriors-01", AREA, "full_ggn posterior, predict at an expanded (stride-0) test tensor")
def full_expanded_test_inputs():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn")
    point = x_test[3:4]
    m, v = _glm(posterior, point.expand(4, 1))
    ref = weight_space_variances(net, x, point, NOISE, 1.0)
    close(v, ref.expand(4), 1e-9, rtol=1e-7, what="variance")
    return HELD, "four equal rows equal to the dense GGN"


@case("posteriors-02", AREA, "diag_ggn posterior with train_x a non-contiguous view (dense diagonal GGN)")
def diag_noncontiguous():
    net, x, y, x_test, lik = _setup()
    view = torch.cat([x, x], dim=1)[:, 1:]
    with untouched(net=net, likelihood=lik):
        posterior = laplace_posterior(net, view, y, lik, structure="diag_ggn")
    _against_dense(posterior, net, x, x_test, diagonal=True)
    return HELD, "equals the dense diagonal GGN"


@case("posteriors-03", AREA, "last-layer posterior with int64 regression targets (dense over the last layer)")
def last_layer_integer_targets():
    net, x, _, x_test, lik = _setup()
    y_int = torch.arange(20) % 3 - 1
    with untouched(net=net, train_y=y_int):
        outcome = attempt(lambda: laplace_posterior(net, x, y_int, lik, structure="full_ggn",
                                                    subset="last_layer"), names=("y",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    _against_dense(outcome, net, x, x_test, names=("2.weight", "2.bias"))
    return HELD, "equals the dense last-layer GGN"


@case("posteriors-04", AREA, "pickle of a used KFAC posterior (after predict)")
def pickle_kfac():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="kfac")
    before = _glm(posterior, x_test)
    loaded = pickle.loads(pickle.dumps(posterior))
    _same(_glm(loaded, x_test), before, 1e-12, "unpickled:")
    return HELD, "equal predictions"


@case("posteriors-05", AREA, "deepcopy of a used full posterior, then the original network's weights changed")
def deepcopy_full_then_change():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn")
    before = _glm(posterior, x_test)
    clone = copy.deepcopy(posterior)
    with torch.no_grad():
        net[0].weight.add_(0.5)
    outcome = attempt(lambda: _glm(clone, x_test), (RuntimeError,), names=("weights",))
    if isinstance(outcome, Refused):
        if clone.function.net is not net:
            raise SilentWrong("the copy holds its own network but refuses")
        return CLEAR, str(outcome)
    _same(outcome, before, 1e-12, "the copy:")
    refusal(lambda: _glm(posterior, x_test), (RuntimeError,), names=("weights",))
    return HELD, "the copy keeps its network; the original refuses"


@case("posteriors-06", AREA, "torch.save / torch.load of a used diag_ef posterior")
def torch_save_diag_ef():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ef")
    before = _glm(posterior, x_test)
    buffer = io.BytesIO()
    torch.save(posterior, buffer)
    buffer.seek(0)
    _same(_glm(torch.load(buffer, weights_only=False), x_test), before, 1e-12, "loaded:")
    return HELD, "equal predictions"


@case("posteriors-07", AREA, "KeyboardInterrupt during KFAC construction; no hook left; a rebuild is right")
def interrupt_kfac_construction():
    net, x, y, x_test, lik = _setup()
    reference = _glm(laplace_posterior(copy.deepcopy(net), x, y, lik, structure="kfac"), x_test)
    with untouched(net=net, likelihood=lik, train_x=x):
        hook = Interrupter(net[2], at=2)
        try:
            expect_interrupt(lambda: laplace_posterior(net, x, y, lik, structure="kfac"))
        finally:
            hook.remove()
    _same(_glm(laplace_posterior(net, x, y, lik, structure="kfac"), x_test), reference, 1e-12, "rebuilt:")
    return HELD, "network as before, rebuild equals a fresh posterior"


@case("posteriors-08", AREA, "KeyboardInterrupt during predict(method='glm_mc'), then predict again")
def interrupt_predict():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn")
    def draws():
        return {"method": "glm_mc", "num_samples": 20, "generator": torch.Generator().manual_seed(1)}

    reference = _glm(posterior, x_test, **draws())
    hook = Interrupter(net, at=1)
    try:
        expect_interrupt(lambda: _glm(posterior, x_test, method="glm_mc", num_samples=20))
    finally:
        hook.remove()
    after = _glm(posterior, x_test, **draws())
    _same(after, reference, 1e-12, "after the interrupt:")
    return HELD, "the same draws give the same predictive"


@case("posteriors-09", AREA, "posterior.prior_precision = -1 on a KFAC posterior")
def negative_prior_precision():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="kfac")
    before = _glm(posterior, x_test)
    result = refusal(lambda: setattr(posterior, "prior_precision", -1.0), names=("prior_precision",))
    _same(_glm(posterior, x_test), before, 0.0, "after the refused setter:")
    return result


@case("posteriors-10", AREA, "likelihood.noise changed after predicting with a full posterior")
def noise_changed_full():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn")
    _glm(posterior, x_test)
    lik.noise = 0.02
    _against_dense(posterior, net, x, x_test, noise=0.02, what="after noise 0.1 -> 0.02:")
    return HELD, "re-weighted"


@case("posteriors-11", AREA, "the user's prior_precision tensor written after building a diag posterior")
def prior_tensor_written():
    net, x, y, x_test, lik = _setup()
    delta = torch.tensor([2.0, 2.0], dtype=F64)
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn", prior_precision=delta)
    delta.fill_(50.0)
    _against_dense(posterior, net, x, x_test, delta=2.0, diagonal=True, what="after the user's write:")
    return HELD, "copied"


@case("posteriors-12", AREA, "requires_grad_(False) on a parameter after building a full posterior")
def frozen_after_building():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn")
    before = _glm(posterior, x_test)
    net[0].weight.requires_grad_(False)
    outcome = attempt(lambda: _glm(posterior, x_test), (RuntimeError, ValueError),
                      names=("requires_grad", "frozen", "trainable"))
    net[0].weight.requires_grad_(True)
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    _same(outcome, before, 1e-12, "after freezing (the posterior is over its own parameters):")
    return HELD, "unchanged: over the parameters it was built for"


@case("posteriors-13", AREA, "predict with x a numpy array")
def numpy_test_inputs():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn")
    return refusal(lambda: predict(posterior, x_test.numpy()), (TypeError,), names=("x",))


@case("posteriors-14", AREA, "predict with int64 test inputs (to a float network)")
def integer_test_inputs():
    # integer inputs are legitimate for a network that embeds them, so the network's own refusal, re-raised as
    # a ValueError naming x (docs/guarantees.md), is a clear error too
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="kfac")
    return refusal(lambda: predict(posterior, torch.arange(5)[:, None]), (TypeError, ValueError), names=("x",))


@case("posteriors-15", AREA, "predict(num_samples=True, method='nn_sampling')")
def bool_num_samples():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn")
    return refusal(lambda: predict(posterior, x_test, method="nn_sampling", num_samples=True),
                   names=("num_samples",))


@case("posteriors-16", AREA, "a float32 copy of a diag_ggn posterior against float64")
def float32_diag():
    net, x, y, x_test, lik = _setup()
    net32 = copy.deepcopy(net).float()
    posterior32 = laplace_posterior(net32, x.float(), y.float(), gaussian(NOISE, torch.float32),
                                    structure="diag_ggn")
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn")
    m32, v32 = _glm(posterior32, x_test.float())
    m, v = _glm(posterior, x_test)
    close(m32, m, 1e-5, what="float32 mean")
    close(v32, v, 1e-6, rtol=1e-4, what="float32 variance")
    return HELD, "within float32 rounding"


@case("posteriors-17", AREA, "laplace_posterior with y a numpy array")
def numpy_targets():
    net, x, y, x_test, lik = _setup()
    with untouched(net=net):
        return refusal(lambda: laplace_posterior(net, x, y.numpy(), lik, structure="full_ggn"), (TypeError,),
                       names=("y",))


@case("posteriors-18", AREA, "training inputs that require grad: no graph, .grad of x untouched")
def inputs_requiring_grad():
    net, x, y, x_test, lik = _setup()
    x_grad = x.clone().requires_grad_(True)
    with untouched(net=net, train_x=x_grad):
        posterior = laplace_posterior(net, x_grad, y, lik, structure="kfac")
        m, v = _glm(posterior, x_test)
    if v.requires_grad or m.requires_grad:
        raise SilentWrong("the returned predictive carries an autograd graph (documented: detached)")
    return HELD, "detached, nothing written"


@case("posteriors-19", AREA, "prior_precision a numpy array for a full posterior (dense reference at δ = 3)")
def numpy_prior_precision():
    net, x, y, x_test, lik = _setup()
    delta = np.array([3.0, 3.0])
    outcome = attempt(lambda: laplace_posterior(net, x, y, lik, structure="full_ggn", prior_precision=delta),
                      names=("prior_precision",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    _against_dense(outcome, net, x, x_test, delta=3.0)
    return HELD, "accepted, equal to the dense GGN at δ = 3"


@case("posteriors-20", AREA, "KeyboardInterrupt from the likelihood (its noise) in the first predict, then again")
def interrupt_in_likelihood():
    from .references import InterruptingGaussian, interrupting_gaussian

    net, x, y, x_test, _ = _setup()
    lik = interrupting_gaussian(NOISE)
    posterior = laplace_posterior(net, x, y, lik, structure="full_ggn")
    InterruptingGaussian.arm(1)
    try:
        expect_interrupt(lambda: _glm(posterior, x_test))
    finally:
        InterruptingGaussian.disarm()
    _against_dense(posterior, net, x, x_test, what="after the interrupt:")
    return HELD, "no half-filled cache"
