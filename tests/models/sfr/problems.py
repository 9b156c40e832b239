"""Small SFR problems and independent dense references (brute-force Jacobians), shared by the SFR tests."""

from __future__ import annotations

import torch
from gpytorch.likelihoods import GaussianLikelihood, MultitaskGaussianLikelihood

from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from tests.helpers import brute_jacobian, column_groups, mlp, rel_err

__all__ = [
    "DELTA",
    "D_IN",
    "NEW_DELTA",
    "Dense",
    "assert_same",
    "change_delta",
    "dense_moments",
    "layer_labels",
    "predictions",
    "problem",
    "sfr_formula",
    "sfr_factory",
    "sfr_outputs",
    "site_terms",
]

DELTA = torch.tensor([0.7, 2.0, 1.3], dtype=torch.float64)
D_IN = 3
NEW_DELTA = torch.tensor([0.3, 4.0, 2.0], dtype=torch.float64)


def layer_labels(net) -> dict[str, int]:
    """Parameter name -> index of its owning module (one group per layer), without ntkgp's grouping code."""
    prefixes: list[str] = []
    for name, _ in net.named_parameters():
        prefix = name.rsplit(".", 1)[0]
        if prefix not in prefixes:
            prefixes.append(prefix)
    return {name: prefixes.index(name.rsplit(".", 1)[0]) for name, _ in net.named_parameters()}


def site_terms(kind: str, f: torch.Tensor, y: torch.Tensor, noise: float = 0.1):
    """g (N, C), Λ (N, C, C) and log p (N,) written out by hand."""
    if kind == "gaussian":
        y = y.reshape(f.shape)
        lam = torch.diag_embed(torch.full_like(f, 1 / noise))
        logp = (-0.5 * (torch.log(torch.tensor(2 * torch.pi * noise)) + (y - f) ** 2 / noise)).sum(-1)
        return (y - f) / noise, lam, logp
    if kind == "logistic":
        p = torch.sigmoid(f)
        yy = y.reshape(f.shape).to(f)
        logp = (yy * torch.log(p) + (1 - yy) * torch.log(1 - p)).squeeze(-1)
        return yy - p, (p * (1 - p)).unsqueeze(-1), logp
    p = torch.softmax(f, -1)
    onehot = torch.nn.functional.one_hot(y, f.shape[1]).to(f)
    return onehot - p, torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2), (onehot * torch.log(p)).sum(-1)


class Dense:
    """Everything about the linearized network at θ*, from brute-force Jacobians."""

    def __init__(self, net, x, y, kind, delta=DELTA, noise=0.1):
        self.net, self.kind = net, kind
        self.j, _ = brute_jacobian(net, x)
        self.cols = column_groups(net, layer_labels(net))
        self.p0 = delta[self.cols]
        self.theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        with torch.no_grad():
            self.f = net(x)
        self.n, self.c = self.f.shape
        self.g, self.lam, self.logp = site_terms(kind, self.f, y, noise)
        self.lam_big = torch.block_diag(*self.lam)
        self.lin_mean = self.f.reshape(-1) - self.j @ self.theta

    def kernel(self, j1, j2):
        return (j1 / self.p0) @ j2.T

    def weight_space_glm(self, xs):
        """Laplace GLM predictive: f* + J* H⁻¹(Jᵀg − P0θ*), J* H⁻¹ J*ᵀ."""
        js, _ = brute_jacobian(self.net, xs)
        h = self.j.T @ self.lam_big @ self.j + torch.diag(self.p0)
        step = torch.linalg.solve(h, self.j.T @ self.g.reshape(-1) - self.p0 * self.theta)
        with torch.no_grad():
            fs = self.net(xs).reshape(-1)
        return fs + js @ step, js @ torch.linalg.solve(h, js.T)

    def gp_posterior(self, xs, mean="zero"):
        """Exact GP posterior with Gaussian sites (Λ f + g, Λ), written without inverting Λ."""
        js, _ = brute_jacobian(self.net, xs)
        k, ks, kss = self.kernel(self.j, self.j), self.kernel(js, self.j), self.kernel(js, js)
        with torch.no_grad():
            fs = self.net(xs).reshape(-1)
        m = torch.zeros_like(self.lin_mean) if mean == "zero" else self.lin_mean
        ms = torch.zeros_like(fs) if mean == "zero" else fs - js @ self.theta
        r = self.lam_big @ (self.f.reshape(-1) - m) + self.g.reshape(-1)
        eye = torch.eye(k.shape[0], dtype=k.dtype)
        inner = torch.linalg.solve(eye + self.lam_big @ k, torch.cat([r[:, None], self.lam_big @ ks.T], 1))
        return ms + ks @ inner[:, 0], kss - ks @ inner[:, 1:]


def sfr_formula(dense: Dense, z_idx, xs, mean="zero", independent=False):
    """The SFR predictive written out densely (docs/math.md, "SFR"), for Z = X[z_idx]."""
    js, _ = brute_jacobian(dense.net, xs)
    c = dense.c
    rows = (z_idx[:, None] * c + torch.arange(c)).reshape(-1)
    jz = dense.j[rows]
    with torch.no_grad():
        fs = dense.net(xs).reshape(-1)
    m = torch.zeros_like(dense.lin_mean) if mean == "zero" else dense.lin_mean
    ms = torch.zeros_like(fs) if mean == "zero" else fs - js @ dense.theta
    lam = dense.lam_big
    if independent:
        lam = torch.diag(torch.diagonal(lam))
    r = lam @ (dense.f.reshape(-1) - m) + dense.g.reshape(-1)
    outs = []
    for cc in range(c) if independent else [None]:
        def sel(a, cc=cc):
            return a[cc::c] if independent else a

        kzz, kzx = dense.kernel(sel(jz), sel(jz)), dense.kernel(sel(jz), sel(dense.j))
        ksz, kss = dense.kernel(sel(js), sel(jz)), dense.kernel(sel(js), sel(js))
        lam_c = lam[cc::c, cc::c] if independent else lam
        b_u, y_u = kzx @ lam_c @ kzx.T, kzx @ sel(r)
        mu = sel(ms) + ksz @ torch.linalg.solve(kzz + b_u, y_u)
        cov = kss - ksz @ (torch.linalg.solve(kzz, ksz.T) - torch.linalg.solve(kzz + b_u, ksz.T))
        outs.append((mu, cov))
    if not independent:
        return outs[0]
    n = xs.shape[0]
    mu = torch.stack([o[0] for o in outs], 1).reshape(-1)
    cov = torch.zeros(n, c, n, c, dtype=mu.dtype)
    for cc, (_, cv) in enumerate(outs):
        cov[:, cc, :, cc] = cv
    return mu, cov.reshape(n * c, n * c)


def problem(kind: str, c: int = 1, n: int = 12, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(n, D_IN, dtype=torch.float64)
    net = mlp(D_IN, 6, c, depth=2, seed=seed)
    with torch.no_grad():
        f = net(x)
    if kind == "gaussian":
        y = (f + 0.3 * torch.randn_like(f)).squeeze(-1) if c == 1 else f + 0.3 * torch.randn_like(f)
        lik = (GaussianLikelihood() if c == 1 else MultitaskGaussianLikelihood(c, rank=0, has_global_noise=False)).double()
        if c == 1:
            lik.noise = 0.1
        else:
            lik.task_noises = torch.full((c,), 0.1, dtype=torch.float64)
    elif kind == "logistic":
        y = torch.bernoulli(torch.sigmoid(f.squeeze(-1)))
        lik = LogisticLikelihood().double()
    else:
        y = torch.distributions.Categorical(logits=f).sample()
        lik = SoftmaxLikelihood(c).double()
    xs = torch.randn(5, D_IN, dtype=torch.float64)
    return net, x, y, lik, xs


def dense_moments(dist):
    mean = dist.mean.reshape(-1)
    return mean, dist.covariance_matrix


# ---------------------------------------------------------------------- comparing models
def predictions(model, xs):
    mean, cov = dense_moments(model(xs))
    return mean, cov, model.log_marginal_likelihood().detach()


def assert_same(a, b, tol=1e-10):
    for u, v in zip(a, b):
        assert rel_err(u, v) < tol


def change_delta(sfr, route: str) -> torch.Tensor:
    kernel = sfr.covar_module
    constraint = kernel.raw_prior_precision_constraint
    if route == "setter":
        kernel.prior_precision = NEW_DELTA
    elif route == "data":
        kernel.raw_prior_precision.data.copy_(constraint.inverse_transform(NEW_DELTA))
    elif route == "load_state_dict":
        state = sfr.state_dict()
        state["covar_module.raw_prior_precision"] = constraint.inverse_transform(NEW_DELTA)
        sfr.load_state_dict(state)
    else:  # an optimizer step with a fixed gradient
        optimizer = torch.optim.SGD([kernel.raw_prior_precision], lr=0.5)
        kernel.raw_prior_precision.grad = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
        optimizer.step()
    return kernel.prior_precision.detach().clone()


# ---------------------------------------------------------------------- a model for option tests
def sfr_factory(**options):
    """A small SFR (softmax, C = 3, N = 20, M = 6 random inducing inputs, δ per layer) built with ``options``: the
    factory of the option tests (each assignment is compared with a model built here with that value)."""
    import dataclasses

    from ntkgp.models.sfr import SFR, SFRInducingOptions, SFRMemoryOptions

    for key, group in {"inducing": SFRInducingOptions, "memory": SFRMemoryOptions}.items():  # grouped options
        moved = {f.name: options.pop(f.name) for f in dataclasses.fields(group) if f.name in options}
        if moved:
            options[key] = group(**moved)
    net, x, y, lik, _ = problem("softmax", 3, n=20)
    return SFR(net, x, y, lik, num_inducing=6, prior_precision=DELTA, **options)


def sfr_outputs(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a model computes at the test points of :func:`sfr_factory`: mean, dense covariance, evidence."""
    xs = problem("softmax", 3, n=20)[4]
    mean, cov = dense_moments(model(xs))
    return mean.detach(), cov.detach(), model.log_marginal_likelihood().detach()
