"""Audit cases of numerics: float32 copies against float64, extreme prior precisions, near-singular inputs.

Each value is compared with a dense float64 computation (torch.func Jacobians, ``torch.linalg.solve``).
"""

from __future__ import annotations

import copy
import warnings

import gpytorch
import torch

import ntkgp
from ntkgp.laplace import laplace_posterior, predict
from ntkgp.likelihoods import LogisticLikelihood

from .framework import HELD, SilentWrong, case, close
from .references import F64, binary, fit, gaussian, glm_predictive, mlp, regression, weight_space_variances
from ntkgp.training import HyperparameterSchedule

AREA = "numerics"


def _predict(model, x_test):
    with torch.no_grad():
        pred = model(x_test)
        return pred.mean, pred.variance


def _regression(n=20, hidden=8, steps=150):
    x, y = regression(n)
    return fit(mlp(hidden=hidden), x, y, steps=steps), x, y, torch.linspace(-2.5, 2.5, 7, dtype=F64)[:, None]


def _warned(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, [w for w in caught if issubclass(w.category, (RuntimeWarning, UserWarning))]


@case("numerics-01", AREA, "NTKGP with a huge prior precision (δ = 1e8): posterior ≈ prior, against dense")
def huge_prior_precision():
    net, x, y, x_test = _regression()
    model = ntkgp.NTKGP(net, x, y, gaussian(), prior_precision=1e8).eval()
    m, v = _predict(model, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1e8, 0.1)
    close(m, ref_m, 1e-9, what="mean")
    close(v, ref_v, 0.0, rtol=1e-6, what="variance (of order 1e-8)")
    return HELD, "equals the dense GLM"


@case("numerics-02", AREA, "NTKGP at δ = 1e-8 (train_marglik's floor), N > P, against a 30-digit solve")
def small_prior_precision():
    from linear_operator.utils.warnings import NumericalWarning

    net, x, y, x_test = _regression(n=60, hidden=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ntkgp.NTKGP(net, x, y, gaussian(), prior_precision=1e-8).eval()
        m, v = _predict(model, x_test)
    if any(issubclass(w.category, NumericalWarning) for w in caught):
        return HELD, "warned (NumericalWarning)"
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1e-8, 0.1, digits=30)
    std = ref_v.sqrt()
    close(m / std, ref_m / std, 1e-2, what="mean, in predictive standard deviations (tolerance 0.01),")
    close(v, ref_v, 0.0, rtol=1e-6, what="variance")
    return HELD, "equals the extended-precision GLM"


@case("numerics-03", AREA, "NTKGP on training inputs in pairs 1e-9 apart (near-singular Gram), against dense")
def near_duplicate_inputs():
    x0, y0 = regression(15)
    x = torch.cat([x0, x0 + 1e-9])
    y = torch.cat([y0, y0])
    net = fit(mlp(), x, y)
    x_test = torch.linspace(-2.5, 2.5, 7, dtype=F64)[:, None]
    model = ntkgp.NTKGP(net, x, y, gaussian(0.01)).eval()
    m, v = _predict(model, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, 0.01)
    close(m, ref_m, 1e-7, what="mean")
    close(v, ref_v, 1e-8, rtol=1e-5, what="variance")
    return HELD, "equals the dense GLM"


@case("numerics-04", AREA, "a float32 copy of a logistic NTKGP against float64 (mean and variance)")
def float32_logistic_ntkgp():
    x, y = binary(40)
    net = fit(mlp(2, 8, 1), x, y, loss="bce")
    x_test = torch.randn(8, 2, dtype=F64, generator=torch.Generator().manual_seed(2))
    model = ntkgp.NTKGP(net, x, y, LogisticLikelihood().double()).eval()
    model32 = ntkgp.NTKGP(copy.deepcopy(net).float(), x.float(), y.float(), LogisticLikelihood()).eval()
    m, v = _predict(model, x_test)
    m32, v32 = _predict(model32, x_test.float())
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, None)
    close(m, ref_m, 1e-8, what="float64 mean against dense")
    close(m32, ref_m, 1e-3, rtol=1e-3, what="float32 mean")
    close(v32, ref_v, 1e-4, rtol=1e-3, what="float32 variance")
    return HELD, "float32 within 1e-3"


@case("numerics-05", AREA, "a float32 copy of a logistic SFR (Z = X) against the float64 dense GLM")
def float32_logistic_sfr():
    x, y = binary(40)
    net = fit(mlp(2, 8, 1), x, y, loss="bce")
    x_test = torch.randn(8, 2, dtype=F64, generator=torch.Generator().manual_seed(2))
    model32 = ntkgp.SFR(copy.deepcopy(net).float(), x.float(), y.float(), LogisticLikelihood(),
                        inducing_points=x.float())
    m32, v32 = _predict(model32, x_test.float())
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1.0, None)
    close(m32, ref_m, 1e-2, rtol=1e-2, what="float32 SFR mean")
    close(v32, ref_v, 1e-2, rtol=1e-2, what="float32 SFR variance")
    return HELD, "float32 within 1e-2"


@case("numerics-06", AREA, "saturated tanh units: inputs of scale 1e4, against dense")
def saturated_inputs():
    x, y = regression(20)
    net = fit(mlp(), x, y)
    x_big = x * 1e4
    x_test = torch.linspace(-3e4, 3e4, 7, dtype=F64)[:, None]
    model = ntkgp.NTKGP(net, x_big, y, gaussian()).eval()
    m, v = _predict(model, x_test)
    ref_m, ref_v = glm_predictive(net, x_big, y, x_test, 1.0, 0.1)
    close(m, ref_m, 1e-8, what="mean")
    close(v, ref_v, 1e-8, rtol=1e-6, what="variance")
    return HELD, "equals the dense GLM"


@case("numerics-07", AREA, "full_ggn posterior with δ = 1e-8 and P > N (singular GGN), against dense")
def tiny_delta_full_posterior():
    x, y = regression(10)
    net = fit(mlp(hidden=10), x, y)
    x_test = torch.linspace(-2.5, 2.5, 7, dtype=F64)[:, None]
    posterior = laplace_posterior(net, x, y, gaussian(), structure="full_ggn", prior_precision=1e-8)
    (prediction, caught) = _warned(lambda: predict(posterior, x_test))
    ref = weight_space_variances(net, x, x_test, 0.1, 1e-8)
    close(prediction.f.variance, ref, 0.0, rtol=1e-4, what="variance (of order 1e8)")
    return HELD, f"equals the dense GGN to 1e-4 relative{' (warned)' if caught else ''}"


@case("numerics-08", AREA, "SFR (Z = X) with a huge prior precision δ = 1e6, against dense")
def huge_delta_sfr():
    net, x, y, x_test = _regression()
    model = ntkgp.SFR(net, x, y, gaussian(), inducing_points=x, prior_precision=1e6)
    m, v = _predict(model, x_test)
    ref_m, ref_v = glm_predictive(net, x, y, x_test, 1e6, 0.1)
    close(m, ref_m, 1e-6, what="mean")
    close(v, ref_v, 0.0, rtol=1e-4, what="variance (of order 1e-6)")
    return HELD, "equals the dense GLM"


@case("numerics-09", AREA, "a float32 copy of a KFAC posterior against float64 (glm variances)")
def float32_kfac():
    net, x, y, x_test = _regression()
    p64 = laplace_posterior(net, x, y, gaussian(), structure="kfac")
    p32 = laplace_posterior(copy.deepcopy(net).float(), x.float(), y.float(), gaussian(0.1, torch.float32),
                            structure="kfac")
    v64 = predict(p64, x_test).f.variance
    v32 = predict(p32, x_test.float()).f.variance
    close(v32, v64, 1e-6, rtol=1e-3, what="float32 KFAC variance")
    return HELD, "within 1e-3 relative"


@case("numerics-10", AREA, "a float32 two-output MultitaskGaussian NTKGP against float64 (noise 0.05)")
def float32_multitask():
    x, _ = regression(20)
    y = torch.stack([torch.sin(2 * x[:, 0]), torch.cos(x[:, 0])], dim=-1)
    net = mlp(1, 8, 2)
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0).double()
    lik.noise = 1e-4
    lik.task_noises = torch.tensor([0.05, 0.05])
    lik32 = copy.deepcopy(lik).float()
    x_test = torch.linspace(-2.5, 2.5, 5, dtype=F64)[:, None]
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    model32 = ntkgp.NTKGP(copy.deepcopy(net).float(), x.float(), y.float(), lik32).eval()
    m, v = _predict(model, x_test)
    m32, v32 = _predict(model32, x_test.float())
    close(m32, m, 1e-3, rtol=1e-3, what="float32 mean")
    close(v32, v, 1e-4, rtol=1e-3, what="float32 variance")
    return HELD, "within 1e-3"


@case("numerics-11", AREA, "train_marglik on targets of scale 1e3: the evidence against a brute-force one")
def large_target_scale():
    from ntkgp.training import train_marglik

    from .references import log_evidence

    x, y = regression(20)
    y = 1e3 * y
    net = mlp()
    lik = gaussian(1e4)
    result = train_marglik(net, x, y, lik, epochs=6, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=0, frequency=2, hyper_steps=5),
                           prior_structure="network", progress=False)
    delta = result.prior_precision.reshape(-1)[0].item()
    brute = log_evidence(net, x, y, delta, lik.noise.item()) / 20
    close(result.log_evidence, brute, 1e-8, rtol=1e-10, what="evidence / N")
    if not 1e-2 < lik.noise.item() < 1e8:
        raise SilentWrong(f"noise left at {lik.noise.item():.3g}")
    return HELD, f"log q(D)/N = {result.log_evidence:.3f}"


@case("numerics-12", AREA, "a float32 SFR regression with noise 1e-3 against float64: agrees or warns")
def float32_sfr_small_noise():
    from linear_operator.utils.warnings import NumericalWarning

    x, y = regression(40, d=2)
    net = fit(mlp(2, 16, 1), x, y, steps=200)
    x_test = torch.randn(10, 2, dtype=F64, generator=torch.Generator().manual_seed(4))
    z = x[::2].clone()
    model = ntkgp.SFR(net, x, y, gaussian(1e-3), inducing_points=z)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model32 = ntkgp.SFR(copy.deepcopy(net).float(), x.float(), y.float(), gaussian(1e-3, torch.float32),
                            inducing_points=z.float())
        m32, v32 = _predict(model32, x_test.float())
    m, v = _predict(model, x_test)
    if any(issubclass(w.category, NumericalWarning) for w in caught):
        return HELD, "warned (NumericalWarning)"
    std = v.sqrt()
    close(m32 / std, m / std, 1e-2, what="float32 mean in float64 predictive stds (tolerance 0.01):")
    close(v32, v, 1e-4, rtol=0.1, what="float32 variance")
    return HELD, "within 0.01 standard deviations"


@case("numerics-13", AREA, "a float32 NTKGP regression with noise 1e-2 against float64: agrees or warns")
def float32_ntkgp_mean():
    from linear_operator.utils.warnings import NumericalWarning

    x, y = regression(60)
    net = fit(mlp(1, 16, 1), x, y, steps=300)
    x_test = torch.linspace(-2, 2, 9, dtype=F64)[:, None]
    model = ntkgp.NTKGP(net, x, y, gaussian(1e-2)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model32 = ntkgp.NTKGP(copy.deepcopy(net).float(), x.float(), y.float(),
                              gaussian(1e-2, torch.float32)).eval()
        m32, v32 = _predict(model32, x_test.float())
    m, v = _predict(model, x_test)
    if any(issubclass(w.category, NumericalWarning) for w in caught):
        return HELD, "warned (NumericalWarning)"
    # here the float32 network output is off by 5e-6 standard deviations and the whole correction is 0.2
    std = v.sqrt()
    close(m32 / std, m / std, 1e-2, what="float32 mean in float64 predictive stds (tolerance 0.01):")
    return HELD, "within 0.01 standard deviations"
