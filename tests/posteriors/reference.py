"""Dense brute-force references for the weight-space posteriors: explicit Jacobians (autograd, row by row),
likelihood terms from torch.distributions, explicit GGN / EF / Kronecker products, explicit inverses."""

from __future__ import annotations

import gpytorch
import torch
from torch import nn

from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from tests.helpers import brute_jacobian, reference_log_prob, reference_terms

DTYPE = torch.float64
LIKELIHOODS = ("gaussian", "multitask", "logistic", "softmax")


def likelihood_case(name: str):
    """``(likelihood, C, log_prob)`` with non-trivial noise / temperature; ``log_prob(f, y)`` per example."""
    if name == "gaussian":
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.3
        return lik, 1, lambda f, y: reference_log_prob("gaussian", f, y, lik.noise.detach().expand(1))
    if name == "multitask":
        lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(
            num_tasks=2, rank=0, has_global_noise=False
        ).double()
        lik.task_noises = torch.tensor([0.2, 0.7], dtype=DTYPE)
        return lik, 2, lambda f, y: reference_log_prob("gaussian", f, y, lik.task_noises.detach())
    if name == "logistic":
        lik = LogisticLikelihood(temperature=0.7).double()
        return lik, 1, lambda f, y: reference_log_prob("logistic", f, y, temperature=lik.temperature.item())
    lik = SoftmaxLikelihood(num_classes=3, temperature=1.3).double()
    return lik, 3, lambda f, y: reference_log_prob("softmax", f, y, temperature=lik.temperature.item())


def targets(name: str, n: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return {
        "gaussian": lambda: torch.randn(n, 1, dtype=DTYPE, generator=g),
        "multitask": lambda: torch.randn(n, 2, dtype=DTYPE, generator=g),
        "logistic": lambda: torch.randint(0, 2, (n, 1), generator=g).to(DTYPE),
        "softmax": lambda: torch.randint(0, 3, (n,), generator=g),
    }[name]()


def columns(net: nn.Module, names: list[str]) -> torch.Tensor:
    """Flat indices of the parameters ``names`` among all trainable parameters of ``net``."""
    offsets, start = {}, 0
    for n, p in net.named_parameters():
        if p.requires_grad:
            offsets[n] = (start, start + p.numel())
            start += p.numel()
    return torch.cat([torch.arange(*offsets[n]) for n in names])


def jacobian(net: nn.Module, x: torch.Tensor, names: list[str] | None = None) -> torch.Tensor:
    """Brute-force ``J`` ``(N, C, P)`` restricted to ``names`` (default all trainable)."""
    j, _all_names = brute_jacobian(net, x)
    n = x.shape[0]
    j = j.reshape(n, -1, j.shape[-1])
    return j if names is None else j[..., columns(net, names)]


def dense_curvature(net, x, y, log_prob, kind: str = "ggn", names: list[str] | None = None) -> torch.Tensor:
    """``Σ_n J_nᵀ Λ_n J_n`` (GGN) or ``Σ_n J_nᵀ g_n g_nᵀ J_n`` (EF), ``(P, P)``."""
    jn = jacobian(net, x, names)
    with torch.no_grad():
        f = net(x)
    g, lam = reference_terms(log_prob, f, y)
    if kind == "ggn":
        return torch.einsum("ncp,ncd,ndq->pq", jn, lam, jn)
    grads = torch.einsum("nc,ncp->np", g, jn)
    return grads.T @ grads


def glm_blocks(
    net, x_test, sigma: torch.Tensor, names: list[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-point ``J Σ Jᵀ`` ``(N, C, C)`` and the joint ``(N·C, N·C)`` from the explicit Jacobian and ``Σ``."""
    jn = jacobian(net, x_test, names)
    n, c, p = jn.shape
    joint = jn.reshape(n * c, p) @ sigma @ jn.reshape(n * c, p).T
    blocks = torch.einsum("ncp,pq,ndq->ncd", jn, sigma, jn)
    return blocks, joint


def kronecker_precision(
    net: nn.Module, curvature, likelihood, delta_groups: torch.Tensor, damping: bool = False
):
    """The KFAC precision with explicit ``torch.kron`` blocks, placed by an index map written here."""
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    sizes = {n: p.numel() for n, p in net.named_parameters() if p.requires_grad}
    offset = dict(zip(names, torch.tensor([0] + [sizes[n] for n in names]).cumsum(0).tolist()))
    total = sum(sizes.values())
    out = torch.zeros(total, total, dtype=DTYPE)
    s = curvature.scale(likelihood)
    covered = []
    for block in curvature.blocks:
        g = torch.einsum("k,kij->ij", s, block.output_factors)
        a = block.input_factor
        d_out, d_a = g.shape[0], a.shape[0]
        fan_in = d_a - (block.bias is not None)
        index = []
        for o in range(d_out):
            for i in range(d_a):
                index.append(offset[block.weight] + o * fan_in + i if i < fan_in else offset[block.bias] + o)
        index = torch.tensor(index)
        delta = delta_groups[block.group]
        if damping:
            eye_g, eye_a = torch.eye(d_out, dtype=DTYPE), torch.eye(d_a, dtype=DTYPE)
            kron = torch.kron(g + delta.sqrt() * eye_g, a + delta.sqrt() * eye_a)
        else:
            kron = torch.kron(g, a) + delta * torch.eye(d_out * d_a, dtype=DTYPE)
        out[index[:, None], index[None, :]] = kron
        covered += [block.weight] + ([block.bias] if block.bias else [])
    rest = [n for n in names if n not in covered]
    if rest:
        cols = columns(net, rest)
        group = curvature.groups.column_groups()
        out[cols, cols] = s @ curvature.diagonal_components + delta_groups[group[cols]]
    return out


TOL = 1e-10


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    assert (a - b).abs().max().item() <= tol * (1 + b.abs().max().item())


def check_against(posterior, net, x_test, precision, names=None) -> None:
    """Every quantity of ``posterior`` against the explicit ``precision`` (P×P)."""
    sigma = torch.linalg.inv(precision)
    close(posterior.dense_precision(), precision)
    v = torch.randn(posterior.num_params, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    close(posterior.covariance_matmul(v), sigma @ v)
    close(posterior.covariance_matmul(v[:, 0]), sigma @ v[:, 0])
    close(posterior.precision_matmul(v), precision @ v)
    close(posterior.log_det_precision(), torch.linalg.slogdet(precision)[1])
    eye = torch.eye(posterior.num_params, dtype=DTYPE)
    b = posterior.sample_from(eye).T  # the sampler's map B: η = B z
    close(b @ b.T, sigma)
    blocks, joint = glm_blocks(net, x_test, sigma, names)
    close(posterior.glm_covariance(x_test), blocks)
    root = posterior.glm_root(x_test)
    root = root.reshape(-1, root.shape[-1])
    close(root @ root.T, joint)
