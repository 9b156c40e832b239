"""Brute-force Laplace evidences for the property-based tests, written without ntkgp: float64 copies of the
network, dense Jacobians by ``torch.func.jacrev``, log-likelihoods by ``torch.distributions`` and their
derivatives by autograd.

With :math:`\\theta^*` the trainable weights, :math:`P_0 = \\operatorname{diag}(\\delta_{g(i)})` and a curvature
:math:`H` (GGN :math:`\\sum_n J_n^\\top \\Lambda_n J_n`, empirical Fisher :math:`\\sum_n g_n g_n^\\top`, or their
diagonals),

.. math:: \\log q(\\mathcal D) = \\sum_n \\log p(y_n \\mid f_n) - \\tfrac12 \\theta^{*\\top} P_0 \\theta^*
    - \\tfrac12 \\log\\lvert I + P_0^{-1/2} H P_0^{-1/2} \\rvert,

and for any positive semi-definite :math:`H` (KFAC too) the log-determinant is :math:`\\ge 0`, so the evidence
is at most the log joint :math:`\\sum_n \\log p(y_n \\mid f_n) - \\tfrac12 \\theta^{*\\top} P_0 \\theta^*`.
"""

from __future__ import annotations

import copy

import gpytorch
import torch
from torch import nn
from torch.func import functional_call, jacrev

STRUCTURE_CURVATURE = {"full_ggn": ("ggn", False), "full_ef": ("ef", False),
                       "diag_ggn": ("ggn", True), "diag_ef": ("ef", True)}


def group_labels(net: nn.Module, prior_structure: str) -> tuple[list[str], list[int]]:
    """The trainable parameter names and the group index of each (``"network"``: one group; ``"layer"``: one
    per module owning parameters, in the order of first appearance)."""
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    labels = ["network"] * len(names) if prior_structure == "network" else [n.rpartition(".")[0] or n for n in names]
    order = list(dict.fromkeys(labels))
    return names, [order.index(label) for label in labels]


def log_likelihoods(likelihood, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``log p(y_n | f_n)`` per point, ``f`` of shape ``(N, C)``, by ``torch.distributions``."""
    if isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood):
        noise = likelihood.noise.detach().double().reshape(())
        return torch.distributions.Normal(f[:, 0], noise.sqrt()).log_prob(y.reshape(-1).double())
    if f.shape[1] == 1 and not isinstance(likelihood, gpytorch.likelihoods.SoftmaxLikelihood):
        return torch.distributions.Bernoulli(logits=f[:, 0]).log_prob(y.reshape(-1).double())
    return torch.distributions.Categorical(logits=f).log_prob(y.reshape(-1).long())


def _problem(net: nn.Module, x: torch.Tensor, prior_structure: str):
    net64 = copy.deepcopy(net).double()
    names, group_of = group_labels(net64, prior_structure)
    params = {n: p.detach() for n, p in net64.named_parameters()}
    sizes = [params[n].numel() for n in names]
    theta = torch.cat([params[n].reshape(-1) for n in names])

    def outputs(flat: torch.Tensor) -> torch.Tensor:
        pieces = dict(zip(names, (t.view_as(params[n]) for t, n in zip(flat.split(sizes), names))))
        return functional_call(net64, {**params, **pieces}, (x.double(),))

    return theta, outputs, torch.cat([torch.full((s,), g) for s, g in zip(sizes, group_of)])


def log_joint(net, x, y, likelihood, prior_structure: str, prior_precision: torch.Tensor) -> float:
    r""":math:`\sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*`."""
    theta, outputs, group = _problem(net, x, prior_structure)
    delta = prior_precision.detach().double()[group]
    with torch.no_grad():
        return float(log_likelihoods(likelihood, outputs(theta), y).sum() - 0.5 * (delta * theta.square()).sum())


def laplace_evidence(net, x, y, likelihood, structure: str, prior_structure: str,
                     prior_precision: torch.Tensor) -> float:
    """The Laplace evidence of a full or diagonal GGN / empirical Fisher (see the module docstring), total."""
    kind, diagonal = STRUCTURE_CURVATURE[structure]
    theta, outputs, group = _problem(net, x, prior_structure)
    delta = prior_precision.detach().double()[group]
    f = outputs(theta).detach()
    jac = jacrev(outputs)(theta)  # (N, C, P)

    def point(fn: torch.Tensor, n: int) -> torch.Tensor:
        return log_likelihoods(likelihood, fn[None], y.reshape(y.shape[0], -1)[n : n + 1]).sum()

    if kind == "ggn":
        lam = torch.stack([-torch.func.hessian(point)(f[n], n) for n in range(f.shape[0])])  # (N, C, C)
        h = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    else:
        grads = torch.stack([torch.func.grad(point)(f[n], n) for n in range(f.shape[0])])  # (N, C)
        g = torch.einsum("nc,ncp->np", grads, jac)
        h = g.T @ g
    if diagonal:
        h = torch.diag(h.diagonal())
    scale = delta.rsqrt()
    inner = torch.eye(h.shape[0], dtype=h.dtype) + scale[:, None] * h * scale[None, :]
    fit = log_likelihoods(likelihood, f, y).sum()
    return float(fit - 0.5 * (delta * theta.square()).sum() - 0.5 * torch.linalg.slogdet(inner)[1])


def jacobian(net: nn.Module, x: torch.Tensor, prior_structure: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """``J`` of the trainable weights, ``(N·C, P)`` with rows ``n·C + c`` (float64), and the group of each column."""
    theta, outputs, group = _problem(net, x, prior_structure)
    if x.shape[0] == 0:  # no rows (autograd through a convolution of no examples fails)
        return theta.new_zeros(0, theta.numel()), group
    jac = jacrev(outputs)(theta)
    return jac.reshape(-1, theta.numel()), group


def ntk(net: nn.Module, x1: torch.Tensor, x2: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    r""":math:`J(X_1) \operatorname{diag}(w_{g(i)}) J(X_2)^\top` (``w = 1`` by default), float64."""
    j1, group = jacobian(net, x1)
    j2, _ = jacobian(net, x2)
    w = torch.ones(()) if weights is None else weights.detach().double()[group]
    return (j1 * w) @ j2.T
