"""Audit cases added in the third round of issue 25: state dicts that do not fit, the meta device, numpy integers,
parameters unfrozen after construction, weights-only checkpoints, real SIGINTs and interrupts in the evidence and
in network sampling, and the float32 mean / tiny δ of the issue's items 1 and 7 (in several areas)."""

from __future__ import annotations

import copy
import io
import os
import signal
import warnings

import numpy as np
import torch

import ntkgp
from ntkgp.fsvi import FSVI
from ntkgp.laplace import laplace_posterior, predict
from ntkgp.training import train_marglik

from .framework import (CLEAR, HELD, Interrupter, SilentWrong, attempt, case, close, expect_interrupt,
                        refusal, untouched)
from .references import (F64, InterruptingGaussian, fit, gaussian, glm_predictive, interrupting_gaussian, mlp,
                         regression)

NOISE = 0.1


def _setup(dtype=F64, n=20):
    x, y = regression(n, dtype=dtype)
    net = fit(mlp(dtype=dtype), x, y)
    return net, x, y, torch.linspace(-2.5, 2.5, 7, dtype=dtype)[:, None], gaussian(NOISE, dtype)


def _moments(model, x):
    with torch.no_grad():
        pred = model(x)
        return pred.mean.detach().clone(), pred.variance.detach().clone()


def _same(a, b, what):
    close(a[0], b[0], 0.0, what=f"{what} mean")
    close(a[1], b[1], 0.0, what=f"{what} variance")


def _dense(model, net, x, y, x_test, delta=1.0, noise=NOISE, what="", tol=1e-7):
    m, v = _moments(model, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, delta, noise)
    close(m, ref_m, tol, what=f"{what} mean")
    close(v, ref_v, 1e-9, rtol=1e-6, what=f"{what} variance")


def _not_a_tensor(state, key_part="prior_precision"):
    """``state`` with its noise tripled (an entry torch would copy) and the prior precision a float."""
    state = {k: (v * 3.0 if "raw_noise" in k and "constraint" not in k else v) for k, v in state.items()}
    key = next(k for k in state if key_part in k and "constraint" not in k)
    state[key] = 2.0
    return state


def _refused_load(model, state, x_test, fresh):
    before = _moments(model, x_test)
    result = refusal(lambda: model.load_state_dict(state), (RuntimeError, ValueError),
                     names=("prior_precision", "noise", "Missing", "expected torch.Tensor"))
    _same(_moments(model, x_test), before, "after the refused load:")
    _same(_moments(model, x_test), _moments(fresh, x_test), "against a fresh model:")
    return result


def _sigint_at(module, at):
    """A forward hook that sends this process a real SIGINT at the ``at``-th call."""
    calls = [0]

    def hook(*args):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGINT)

    return module.register_forward_hook(hook)


# ---------------------------------------------------------------------- NTKGP
@case("ntkgp-28", "ntkgp", "load_state_dict whose prior precision is a float (and whose noise would be copied)")
def ntkgp_load_not_a_tensor():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    return _refused_load(model, _not_a_tensor(model.state_dict()), x_test,
                         ntkgp.NTKGP(net, x, y, gaussian(NOISE)).eval())


@case("ntkgp-29", "ntkgp", "a network on the meta device (weights not loaded yet) at construction")
def ntkgp_meta_network():
    net, x, y, _, lik = _setup()
    meta = copy.deepcopy(net).to("meta")
    with untouched(likelihood=lik, train_x=x, train_y=y):
        return refusal(lambda: ntkgp.NTKGP(meta, x, y, lik), names=("net",))


@case("ntkgp-30", "ntkgp", "chunk_size=np.int64(4), cache_size=np.int64(2) (numpy integers) against Python ints")
def ntkgp_numpy_counts():
    net, x, y, x_test, lik = _setup()
    outcome = attempt(lambda: ntkgp.NTKGP(net, x, y, lik, chunk_size=np.int64(4), cache_size=np.int64(2)))
    if not isinstance(outcome, ntkgp.NTKGP):
        raise RuntimeError(f"valid integers refused: {outcome}")
    _dense(outcome.eval(), net, x, y, x_test)
    return HELD, "accepted, equal to the dense GLM"


@case("ntkgp-31", "ntkgp", "KeyboardInterrupt from the likelihood during log_marginal_likelihood, then again")
def ntkgp_interrupted_evidence():
    return _interrupted_evidence(lambda net, x, y, lik: ntkgp.NTKGP(net, x, y, lik).eval(), 1e-7)


def _interrupted_evidence(build, tol):
    """A KeyboardInterrupt at the first read of the noise in ``log_marginal_likelihood``; then the evidence and
    the predictive equal a fresh model's and the dense GLM (``tol``: the model's tolerance on the mean)."""
    net, x, y, x_test, _ = _setup()
    model = build(net, x, y, interrupting_gaussian(NOISE))
    reference = build(net, x, y, gaussian(NOISE)).log_marginal_likelihood().item()
    InterruptingGaussian.arm(1)
    try:
        expect_interrupt(lambda: model.log_marginal_likelihood())
    finally:
        InterruptingGaussian.disarm()
    close(model.log_marginal_likelihood().item(), reference, 1e-9, what="evidence after the interrupt")
    _dense(model, net, x, y, x_test, what="after the interrupt:", tol=tol)
    return HELD, "no half-filled cache"


@case("ntkgp-32", "ntkgp", "state_dict through torch.save / torch.load(weights_only=True) into a fresh model")
def ntkgp_weights_only():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=3.0).eval()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = ntkgp.NTKGP(net, x, y, gaussian(0.5)).eval()
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    _dense(fresh, net, x, y, x_test, delta=3.0, what="reloaded:")
    return HELD, "equals the dense GLM at the saved δ"


# ---------------------------------------------------------------------- SFR
@case("sfr-23", "sfr", "requires_grad_(True) on a parameter that was frozen when the SFR was built")
def sfr_unfrozen():
    net, x, y, x_test, lik = _setup()
    net[0].bias.requires_grad_(False)
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x)
    before = _moments(model, x_test)
    net[0].bias.requires_grad_(True)
    outcome = attempt(lambda: _moments(model, x_test), (RuntimeError, ValueError),
                      names=("requires_grad", "frozen", "trainable"))
    net[0].bias.requires_grad_(False)
    _same(_moments(model, x_test), before, "once the flag is restored:")
    if not isinstance(outcome, tuple):
        return CLEAR, str(outcome)
    _dense(model, net, x, y, x_test, what="unfrozen, against the dense GLM over all parameters:")
    return HELD, "picked up"


@case("sfr-24", "sfr", "load_state_dict missing the prior precision (strict), after an entry torch would copy")
def sfr_load_missing_key():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, inducing_points=x[:10])
    state = _not_a_tensor(model.state_dict())
    state = {k: v for k, v in state.items() if "raw_prior_precision" not in k or "constraint" in k}
    return _refused_load(model, state, x_test, ntkgp.SFR(net, x, y, gaussian(NOISE), inducing_points=x[:10]))


@case("sfr-25", "sfr", "sfr(x) with x on the meta device, and a meta network at construction")
def sfr_meta():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x, y, lik, num_inducing=8)
    with untouched(net=net):
        refusal(lambda: model(x_test.to("meta")), names=("x",))
    meta = copy.deepcopy(net).to("meta")
    return refusal(lambda: ntkgp.SFR(meta, x, y, lik, num_inducing=8), names=("net",))


@case("sfr-26", "sfr", "KeyboardInterrupt from the likelihood in log_marginal_likelihood, then again")
def sfr_interrupted_evidence():  # Z = X: the dense GLM, to SFR's tolerance
    return _interrupted_evidence(lambda net, x, y, lik: ntkgp.SFR(net, x, y, lik, inducing_points=x), 1e-6)


@case("sfr-27", "sfr", "state_dict of an updated SFR through torch.load(weights_only=True) into a fresh SFR")
def sfr_weights_only():
    net, x, y, x_test, lik = _setup()
    model = ntkgp.SFR(net, x[:12], y[:12], lik, inducing_points=x)
    model.update(x[12:], y[12:])
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = ntkgp.SFR(net, x[:12], y[:12], gaussian(NOISE), inducing_points=x)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    _dense(fresh, net, x, y, x_test, what="reloaded (Z = X, all 20 points):", tol=1e-6)
    return HELD, "the dense GLM on all the data"


@case("sfr-28", "sfr", "a real SIGINT during construction: no hook left, the network as before")
def sfr_sigint():
    net, x, y, _, lik = _setup()
    handle = _sigint_at(net, 2)
    try:
        with untouched(state=True, likelihood=lik, train_x=x, train_y=y):
            expect_interrupt(lambda: ntkgp.SFR(net, x, y, lik, num_inducing=8))
    finally:
        handle.remove()
    with untouched(net=net):
        pass
    return HELD, "propagated, nothing of the user's changed"


# ---------------------------------------------------------------------- FSVI
def _fsvi(net, lik):
    return FSVI(net, lik).eval()


@case("fsvi-22", "fsvi", "load_state_dict whose noise entry is a float (and whose μ would be copied)")
def fsvi_load_not_a_tensor():
    net, lik = mlp(), gaussian(NOISE)
    model = _fsvi(net, lik)
    x_test = torch.linspace(-2, 2, 5, dtype=F64)[:, None]
    state = model.state_dict()
    state = {k: (v + 1.0 if k.startswith("variational") else v) for k, v in state.items()}
    key = next(k for k in state if "raw_noise" in k and "constraint" not in k)
    state[key] = 0.3
    fresh = _fsvi(net, gaussian(NOISE))
    before = _moments(model, x_test)
    result = refusal(lambda: model.load_state_dict(state), (RuntimeError, ValueError),
                     names=("noise", "expected torch.Tensor"))
    _same(_moments(model, x_test), before, "after the refused load:")
    _same(_moments(model, x_test), _moments(fresh, x_test), "against a fresh model:")
    return result


@case("fsvi-23", "fsvi", "train_fsvi with a network on the meta device")
def fsvi_meta_network():
    return _meta_network_refused(lambda net, x, y, lik: ntkgp.fsvi.train_fsvi(net, x, y, lik, epochs=1))


def _meta_network_refused(train):
    """``train(net, x, y, likelihood)`` with a network on the meta device: refused naming ``net``, the likelihood
    and the data untouched."""
    x, y = regression(20)
    meta = mlp().to("meta")
    lik = gaussian(NOISE)
    with untouched(likelihood=lik, train_x=x, train_y=y):
        return refusal(lambda: train(meta, x, y, lik), names=("net",))


@case("fsvi-24", "fsvi", "a real SIGINT during a conditioned model's prediction, then predict again")
def fsvi_sigint_predict():
    x, y = regression(20)
    net, lik = mlp(), gaussian(NOISE)
    model = _fsvi(net, lik).condition_on(x[:6], y[:6])
    x_test = torch.linspace(-2, 2, 5, dtype=F64)[:, None]
    reference = _moments(_fsvi(net, gaussian(NOISE)).condition_on(x[:6], y[:6]), x_test)
    handle = _sigint_at(net, 1)
    try:
        expect_interrupt(lambda: _moments(model, x_test))
    finally:
        handle.remove()
    close(_moments(model, x_test)[0], reference[0], 1e-12, what="mean after the SIGINT")
    close(_moments(model, x_test)[1], reference[1], 1e-12, what="variance after the SIGINT")
    return HELD, "no half-filled cache"


# ---------------------------------------------------------------------- posteriors
@case("posteriors-21", "posteriors", "laplace_posterior(structure='kfac') with a network on the meta device")
def posterior_meta_network():
    net, x, y, _, lik = _setup()
    meta = copy.deepcopy(net).to("meta")
    with untouched(likelihood=lik, x=x, y=y):
        return refusal(lambda: laplace_posterior(meta, x, y, lik, structure="kfac"), names=("net",))


@case("posteriors-22", "posteriors", "KeyboardInterrupt in predict(method='nn_sampling'): network weights as before")
def posterior_interrupted_sampling():
    net, x, y, x_test, lik = _setup()
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn")

    def draws():
        return {"method": "nn_sampling", "num_samples": 10, "generator": torch.Generator().manual_seed(3)}

    reference = predict(posterior, x_test, **draws()).f.mean
    hook = Interrupter(net, at=1)  # its one (vectorized) pass over the sampled weights
    try:
        with untouched(net=net):
            expect_interrupt(lambda: predict(posterior, x_test, **draws()))
    finally:
        hook.remove()
    close(predict(posterior, x_test, **draws()).f.mean, reference, 0.0, what="the same draws after the interrupt")
    return HELD, "weights restored, the same draws give the same predictive"


@case("posteriors-23", "posteriors", "a real SIGINT during a full_ggn construction, then a rebuild")
def posterior_sigint():
    net, x, y, x_test, lik = _setup()
    reference = predict(laplace_posterior(net, x, y, lik, structure="full_ggn"), x_test).f.variance
    handle = _sigint_at(net, 1)
    try:
        with untouched(net=net, likelihood=lik):
            pass
        expect_interrupt(lambda: laplace_posterior(net, x, y, lik, structure="full_ggn"))
    finally:
        handle.remove()
    with untouched(net=net):
        again = predict(laplace_posterior(net, x, y, lik, structure="full_ggn"), x_test).f.variance
    close(again, reference, 0.0, what="variance of the rebuild")
    return HELD, "propagated, rebuild equal"


# ---------------------------------------------------------------------- marglik
@case("marglik-18", "marglik", "train_marglik with a network on the meta device")
def marglik_meta_network():
    return _meta_network_refused(lambda net, x, y, lik: train_marglik(net, x, y, lik, epochs=2, progress=False))


@case("marglik-19", "marglik", "a real SIGINT (os.kill) during the MAP steps of epoch 3")
def marglik_sigint():
    x, y = regression(20)
    net, lik = mlp(), gaussian(NOISE)
    options = {"epochs": 6, "lr": 1e-2, "burn_in": 0, "frequency": 2, "hyper_steps": 5, "progress": False}
    net[2].bias.grad = torch.full_like(net[2].bias, 2.0)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    handle = _sigint_at(net, 10)  # of 18 calls in the whole run
    try:
        with untouched(state=False, net=net, likelihood=lik, train_x=x, train_y=y):
            interrupt = expect_interrupt(lambda: train_marglik(net, x, y, lik, **options))
    finally:
        handle.remove()
    result = getattr(interrupt, "marglik_result", None)
    if result is None:
        raise SilentWrong("the KeyboardInterrupt carries no marglik_result")
    if result.best_epoch < 0:
        for k, v in initial.items():
            close(net.state_dict()[k], v, 0.0, what=f"{k} (initial state expected)")
        return HELD, "initial state"
    recomputed = result.model(x, y).log_marginal_likelihood().item() / x.shape[0]
    close(recomputed, result.log_evidence, 1e-8, what="evidence of the state left vs the best checkpoint's")
    return HELD, f"best checkpoint (epoch {result.best_epoch})"


# ---------------------------------------------------------------------- numerics (items 1 and 7)
@case("numerics-14", "numerics", "the issue's item 1: float32 1-16-1 NTKGP, N = 100, noise 1e-4, against float64")
def float32_mean_issue_case():
    from linear_operator.utils.warnings import NumericalWarning

    x, y = regression(100)
    net = fit(mlp(1, 16, 1), x, y, steps=500)
    x_test = torch.linspace(-2, 2, 11, dtype=F64)[:, None]
    m, v = _moments(ntkgp.NTKGP(net, x, y, gaussian(1e-4)).eval(), x_test)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model32 = ntkgp.NTKGP(copy.deepcopy(net).float(), x.float(), y.float(), gaussian(1e-4, torch.float32))
        m32, _ = _moments(model32.eval(), x_test.float())
    if any(issubclass(w.category, NumericalWarning) for w in caught):
        return HELD, "warned (NumericalWarning)"
    err = close(m32, m, 1e-3, what="float32 mean against float64 (tolerance 1e-3)")
    return HELD, f"within {err:.1e} ({(m32.double() - m).abs().div(v.sqrt()).max().item():.2g} predictive sd)"


@case("numerics-15", "numerics", "NTKGP at δ = 1e-14 (below the sane range), N > P: warns or matches 30 digits")
def tiny_prior_precision():
    from linear_operator.utils.warnings import NumericalWarning

    net, x, y, x_test, lik = _setup(n=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, v = _moments(ntkgp.NTKGP(net, x, y, lik, prior_precision=1e-14).eval(), x_test)
    if any(issubclass(w.category, NumericalWarning) for w in caught):
        return HELD, "warned (NumericalWarning)"
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1e-14, NOISE, digits=30)
    close(m / ref_v.sqrt(), ref_m / ref_v.sqrt(), 1e-2, what="mean in predictive sds (tolerance 0.01)")
    return HELD, "equals the extended-precision GLM"


@case("marglik-20", "marglik", "a likelihood in eval mode (and the network in eval mode): modes kept")
def marglik_likelihood_mode():
    x, y = regression(20)
    net, lik = mlp(), gaussian(NOISE)
    lik.eval()
    options = {"epochs": 4, "lr": 1e-2, "burn_in": 0, "frequency": 2, "hyper_steps": 3, "progress": False}
    with untouched(state=False, net=net, likelihood=lik, train_x=x, train_y=y):
        train_marglik(net, x, y, lik, **options)
    return HELD, "eval mode kept"


@case("sfr-29", "sfr", "a likelihood in training mode: SFR's construction and update keep its mode")
def sfr_likelihood_mode():
    net, x, y, _, lik = _setup()
    lik.train()
    with untouched(net=net, likelihood=lik, train_x=x, train_y=y):
        ntkgp.SFR(net, x, y, lik, num_inducing=8).update(x[:3], y[:3])
    return HELD, "training mode kept"
