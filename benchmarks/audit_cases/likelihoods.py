"""Audit cases of ``ntkgp.likelihoods``: constructor and option checks, targets, the Laplace terms and the
link approximations, against torch.distributions, autograd and brute-force Monte Carlo."""

from __future__ import annotations

import math
import pickle

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal

from ntkgp.likelihoods import (LogisticLikelihood, SoftmaxLikelihood, gradient, hessian, log_likelihood,
                               validate_targets)

from .framework import HELD, SilentWrong, case, close, refusal, untouched
from .references import F64, gaussian

AREA = "likelihoods"


def _logit_dist(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=g, dtype=F64) * 2
    var = torch.rand(n, generator=g, dtype=F64) * 3 + 0.1
    return MultivariateNormal(mean, torch.diag(var)), mean, var


def _softmax_dist(n=4, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, c, generator=g, dtype=F64)
    root = torch.randn(n, c, c, generator=g, dtype=F64)
    blocks = root @ root.transpose(-1, -2) + 0.1 * torch.eye(c, dtype=F64)
    cov = torch.block_diag(*blocks)  # interleaved order: point-major, C outputs per point
    return MultitaskMultivariateNormal(mean, cov, interleaved=True), mean, blocks


@case("likelihoods-01", AREA, "SoftmaxLikelihood(num_classes=2.5)")
def fractional_classes():
    return refusal(lambda: SoftmaxLikelihood(num_classes=2.5), names=("num_classes",))


@case("likelihoods-02", AREA, "LogisticLikelihood().link_approx = 'bogus'; the marginal afterwards")
def bad_link_assignment():
    lik = LogisticLikelihood().double()
    dist, mean, var = _logit_dist()
    before = lik(dist).probs
    result = refusal(lambda: setattr(lik, "link_approx", "bogus"), names=("link_approx",))
    close(lik(dist).probs, before, 0.0, what="probabilities after the refused assignment")
    return result


@case("likelihoods-03", AREA, "SoftmaxLikelihood(3).num_samples = 0")
def zero_samples_assignment():
    lik = SoftmaxLikelihood(3)
    return refusal(lambda: setattr(lik, "num_samples", 0), names=("num_samples",))


@case("likelihoods-04", AREA, "LogisticLikelihood targets in {-1, +1} (a common convention)")
def plus_minus_one_labels():
    y = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    with untouched(y=y):
        return refusal(lambda: validate_targets(LogisticLikelihood(), y, name="train_y"), names=("train_y",))


@case("likelihoods-05", AREA, "LogisticLikelihood probit marginal against σ(μ/√(1 + πσ²/8))")
def probit_formula():
    dist, mean, var = _logit_dist()
    probs = LogisticLikelihood().double()(dist).probs
    close(probs, torch.sigmoid(mean / torch.sqrt(1 + math.pi * var / 8)), 1e-12, what="probabilities")
    return HELD, "the closed form"


@case("likelihoods-06", AREA, "SoftmaxLikelihood link_approx='mc' against a brute-force Monte Carlo")
def softmax_mc():
    dist, mean, blocks = _softmax_dist()
    lik = SoftmaxLikelihood(3, link_approx="mc", num_samples=20000).double()
    probs = lik(dist, generator=torch.Generator().manual_seed(0)).probs
    g = torch.Generator().manual_seed(1)
    z = torch.randn(200000, 4, 3, 1, generator=g, dtype=F64)
    draws = mean + (torch.linalg.cholesky(blocks) @ z).squeeze(-1)
    reference = torch.softmax(draws, -1).mean(0)
    close(probs, reference, 0.01, what="probabilities")
    return HELD, "within Monte Carlo error"


@case("likelihoods-07", AREA, "log_likelihood of a GaussianLikelihood against torch.distributions.Normal")
def gaussian_log_likelihood():
    lik = gaussian(0.3)
    f = torch.randn(5, 1, dtype=F64)
    y = torch.randn(5, dtype=F64)
    reference = torch.distributions.Normal(f[:, 0], math.sqrt(0.3)).log_prob(y)
    close(log_likelihood(lik, f, y), reference, 1e-12, what="log p(y|f)")
    return HELD, "equal"


@case("likelihoods-08", AREA, "tempered (T = 2) softmax gradient and Hessian against autograd")
def softmax_terms_autograd():
    lik = SoftmaxLikelihood(3).double()
    lik.temperature = 2.0  # after .double(): exactly 2 (set before, it would be float32-rounded)
    f = torch.randn(4, 3, dtype=F64)
    y = torch.tensor([0, 2, 1, 2])

    def log_p(logits):
        return torch.log_softmax(logits, -1).gather(-1, y[:, None]).sum() / 2.0

    grad = torch.func.grad(log_p)(f)
    hess = torch.autograd.functional.hessian(log_p, f).reshape(12, 12)
    blocks = torch.stack([-hess[3 * n:3 * n + 3, 3 * n:3 * n + 3] for n in range(4)])
    close(gradient(lik, f, y), grad, 1e-12, what="gradient")
    close(hessian(lik, f, y), blocks, 1e-12, what="Hessian")
    close(log_likelihood(lik, f, y).sum(), log_p(f), 1e-12, what="log likelihood")
    return HELD, "equal to autograd"


@case("likelihoods-09", AREA, "temperature = 0 assigned to a SoftmaxLikelihood")
def zero_temperature():
    lik = SoftmaxLikelihood(3, temperature=1.5)
    result = refusal(lambda: setattr(lik, "temperature", 0.0), names=("temperature",))
    close(lik.temperature, torch.tensor(1.5), 1e-6, what="temperature after the refused assignment")
    return result


@case("likelihoods-10", AREA, "pickle of a SoftmaxLikelihood with link_approx and temperature assigned")
def pickle_assigned_options():
    lik = SoftmaxLikelihood(3).double()
    lik.link_approx = "mc"
    lik.num_samples = 7
    lik.temperature = 2.5
    loaded = pickle.loads(pickle.dumps(lik))
    if str(getattr(loaded.link_approx, "value", loaded.link_approx)) != "mc" or loaded.num_samples != 7:
        raise SilentWrong(f"options lost: {loaded.link_approx!r}, {loaded.num_samples!r}")
    close(loaded.temperature, torch.tensor(2.5, dtype=F64), 1e-12, what="temperature")
    return HELD, "options and temperature kept"


@case("likelihoods-11", AREA, "softmax labels as float (N, 1) whole numbers, and 1.0000001 refused")
def float_labels():
    lik = SoftmaxLikelihood(3)
    y = torch.tensor([[0.0], [2.0], [1.0]])
    with untouched(y=y):
        out = validate_targets(lik, y, name="train_y")
    if out.dtype != torch.long or out.tolist() != [0, 2, 1]:
        raise SilentWrong(f"normalized to {out}")
    almost = torch.tensor([0.0, 1.0000001, 2.0], dtype=F64)
    return refusal(lambda: validate_targets(lik, almost, name="train_y"), names=("train_y",))


@case("likelihoods-12", AREA, "SoftmaxLikelihood given a MultivariateNormal (not multitask)")
def softmax_wrong_distribution():
    dist, _, _ = _logit_dist(6)
    return refusal(lambda: SoftmaxLikelihood(3)(dist), (TypeError, ValueError),
                   names=("MultitaskMultivariateNormal", "function_dist"))


@case("likelihoods-13", AREA, "LogisticLikelihood().learn_temperature = 'yes'")
def string_flag():
    lik = LogisticLikelihood()
    return refusal(lambda: setattr(lik, "learn_temperature", "yes"), names=("learn_temperature",))
