"""Small networks and data for the audit, and the independent computations its value checks compare with.

The references use no ntkgp code: Jacobians by ``torch.func.jacrev`` of a functional call, the GLM predictive
and the weight-space Laplace quantities from dense float64 matrices.
"""

from __future__ import annotations

import copy
import math

import gpytorch
import torch
from torch import nn
from torch.func import functional_call, jacrev

F64 = torch.float64


def mlp(d_in: int = 1, hidden: int = 8, d_out: int = 1, dtype: torch.dtype = F64, seed: int = 0,
        activation=nn.Tanh) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), activation(), nn.Linear(hidden, d_out)).to(dtype).eval()


def regression(n: int = 20, d: int = 1, dtype: torch.dtype = F64, seed: int = 0):
    """``n`` inputs uniform on ``[-2, 2]^d`` and noisy ``Σ sin(2x)`` targets ``(n,)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=F64) * 4 - 2
    y = torch.sin(2 * x).sum(-1) + 0.1 * torch.randn(n, generator=g, dtype=F64)
    return x.to(dtype), y.to(dtype)


def binary(n: int = 30, d: int = 2, dtype: torch.dtype = F64, seed: int = 0):
    """``n`` Gaussian inputs and noisy linear labels in {0, 1} (floating)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = (x[:, 0] + 0.5 * x[:, -1] + 0.3 * torch.randn(n, generator=g, dtype=F64) > 0).to(dtype)
    return x.to(dtype), y


def classes(n: int = 30, d: int = 2, c: int = 3, dtype: torch.dtype = F64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = torch.randint(0, c, (n,), generator=g)
    return x.to(dtype), y


def fit(net: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 150, lr: float = 2e-2,
        loss: str = "mse") -> nn.Module:
    """A short full-batch Adam fit (in place), so that networks are not at their random initialization."""
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        out = net(x)
        if loss == "mse":
            value = (out.squeeze(-1) - y).square().mean()
        elif loss == "bce":
            value = nn.functional.binary_cross_entropy_with_logits(out.squeeze(-1), y)
        else:
            value = nn.functional.cross_entropy(out, y)
        value.backward()
        optimizer.step()
    for p in net.parameters():
        p.grad = None
    return net


def gaussian(noise: float = 0.1, dtype: torch.dtype = F64) -> gpytorch.likelihoods.GaussianLikelihood:
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    likelihood.noise = torch.tensor(noise, dtype=dtype)  # GPyTorch passes a Python float through float32
    return likelihood


class InterruptingGaussian(gpytorch.likelihoods.GaussianLikelihood):
    """A GaussianLikelihood whose noise raises ``KeyboardInterrupt`` at its ``at``-th read once :meth:`arm` was
    called (the count lives on the class, so that copies made by the library count too)."""

    calls, at, armed = 0, 0, False

    @classmethod
    def arm(cls, at: int) -> None:
        cls.calls, cls.at, cls.armed = 0, at, True

    @classmethod
    def disarm(cls) -> int:
        cls.armed = False
        return cls.calls

    @property
    def noise(self):
        cls = type(self)
        if cls.armed:
            cls.calls += 1
            if cls.calls == cls.at:
                raise KeyboardInterrupt
        return super().noise

    @noise.setter
    def noise(self, value):
        gpytorch.likelihoods.GaussianLikelihood.noise.fset(self, value)


def interrupting_gaussian(noise: float = 0.1, dtype: torch.dtype = F64) -> InterruptingGaussian:
    likelihood = InterruptingGaussian().to(dtype)
    likelihood.noise = torch.tensor(noise, dtype=dtype)
    return likelihood


# ---------------------------------------------------------------------- dense references (float64, no ntkgp)
def trainable(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(F64) for n, p in net.named_parameters() if p.requires_grad}


def outputs_and_jacobian(net: nn.Module, x: torch.Tensor, names=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``f(x)`` ``(N, C)`` and ``J`` ``(N·C, P)`` (rows interleaved, columns in parameter order), float64;
    ``names``: only those parameters (default: the trainable ones)."""
    net64 = copy.deepcopy(net).to(F64)
    params = trainable(net64)
    if names is not None:
        params = {n: p.detach() for n, p in net64.named_parameters() if n in names}
    fixed = {n: p.detach() for n, p in net64.named_parameters() if n not in params}
    fixed.update({n: b for n, b in net64.named_buffers()})
    x = x.detach().to(F64)

    def f(p):
        return functional_call(net64, {**fixed, **p}, (x,))

    out = f(params)
    jac = jacrev(f)(params)
    rows = out.numel()
    return out.reshape(x.shape[0], -1), torch.cat([jac[n].reshape(rows, -1) for n in params], dim=1)


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in trainable(net).values()])


def _solve(h: torch.Tensor, b: torch.Tensor, digits: int | None) -> torch.Tensor:
    """``h⁻¹ b`` in float64, or with ``digits`` decimal digits by mpmath (for ill-conditioned ``h``)."""
    if digits is None:
        return torch.linalg.solve(h, b)
    import mpmath

    columns = b.reshape(h.shape[0], -1).T.tolist()
    with mpmath.workdps(digits):
        matrix = mpmath.matrix(h.tolist())
        solved = [[float(v) for v in mpmath.lu_solve(matrix, mpmath.matrix(column))] for column in columns]
    return torch.tensor(solved, dtype=F64).T.reshape(b.shape)


def glm_predictive(net: nn.Module, x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, delta: float,
                   noise: float | None = None, mean: str = "gp", digits: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Laplace-GGN GLM predictive over f for a single-output network, float64: ``(mean, variance)``.

    ``noise`` given: a Gaussian likelihood; ``None``: the logistic likelihood (labels 0/1). ``mean="gp"`` is
    one Newton step from θ*, ``"nn"`` the network's output. ``digits``: solve with that many decimal digits
    (mpmath) instead of float64, for an ill-conditioned ``H`` (the Jacobians are float64 either way).
    """
    f, jac = outputs_and_jacobian(net, x)
    f = f.reshape(-1)
    y = y.detach().to(F64).reshape(-1)
    if noise is not None:
        lam = torch.full_like(f, 1.0 / noise)
        g = (y - f) / noise
    else:
        p = torch.sigmoid(f)
        lam, g = p * (1 - p), y - p
    theta = flat(net)
    h = jac.T @ (lam[:, None] * jac) + delta * torch.eye(jac.shape[1], dtype=F64)
    f_test, j_test = outputs_and_jacobian(net, x_test)
    cov = j_test @ _solve(h, j_test.T, digits)
    mu = f_test.reshape(-1)
    if mean == "gp":
        mu = mu + j_test @ _solve(h, jac.T @ g - delta * theta, digits)
    return mu, cov.diagonal()


def log_evidence(net: nn.Module, x: torch.Tensor, y: torch.Tensor, delta: float, noise: float) -> float:
    """The Laplace-GGN log evidence of a single-output regression network, float64 (one δ for all weights)."""
    f, jac = outputs_and_jacobian(net, x)
    y = y.detach().to(F64).reshape(-1)
    n, p = jac.shape
    theta = flat(net)
    log_lik = -0.5 * ((y - f.reshape(-1)) ** 2).sum() / noise - 0.5 * n * math.log(2 * math.pi * noise)
    h = jac.T @ jac / noise + delta * torch.eye(p, dtype=F64)
    return (log_lik - 0.5 * delta * theta @ theta + 0.5 * p * torch.log(torch.tensor(delta, dtype=F64))
            - 0.5 * torch.linalg.slogdet(h)[1]).item()


def weight_space_variances(net: nn.Module, x: torch.Tensor, x_test: torch.Tensor, noise: float, delta: float,
                           names=None, diagonal: bool = False) -> torch.Tensor:
    """GLM variances ``J* Σ J*ᵀ`` of a single-output Gaussian regression, ``Σ = (JᵀJ/σ² + δI)⁻¹`` over the
    parameters ``names`` (default all trainable), or over ``diag(JᵀJ/σ²) + δ`` with ``diagonal``."""
    _, jac = outputs_and_jacobian(net, x, names)
    _, j_test = outputs_and_jacobian(net, x_test, names)
    h = jac.T @ jac / noise
    if diagonal:
        return (j_test.square() / (h.diagonal() + delta)).sum(-1)
    h = h + delta * torch.eye(h.shape[0], dtype=F64)
    return (j_test @ torch.linalg.solve(h, j_test.T)).diagonal()
