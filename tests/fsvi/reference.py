"""Brute-force references for the FSVI tests, written without ntkgp: dense Jacobians by autograd."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


def flat(params: dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([params[n].reshape(-1) for n in names])


def unflat(theta: torch.Tensor, like: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for n in names:
        k = like[n].numel()
        out[n] = theta[start : start + k].view_as(like[n])
        start += k
    return out


def jacobian(net: nn.Module, params: dict[str, torch.Tensor], names, x: torch.Tensor, create_graph=False) -> torch.Tensor:
    """``J`` of shape ``(N·C, P)`` (rows n·C + c) at the weights ``params``, by ``torch.autograd.functional``."""
    theta = flat(params, names)

    def f(th):
        return functional_call(net, unflat(th, params, names), (x,)).reshape(-1)

    return torch.autograd.functional.jacobian(f, theta, create_graph=create_graph)


def covariance(net, params, variances, names, x1, x2=None, create_graph=False) -> torch.Tensor:
    """``J(x1) diag(v) J(x2)ᵀ`` with dense Jacobians; 0-dim variances are broadcast over their tensor."""
    v = torch.cat([variances[n].expand(params[n].shape).reshape(-1) for n in names])
    j1 = jacobian(net, params, names, x1, create_graph)
    j2 = j1 if x2 is None else jacobian(net, params, names, x2, create_graph)
    return (j1 * v) @ j2.T


class SmallCNN(nn.Module):
    """Conv → BatchNorm (eval) → ReLU → pool → Linear → tanh → Linear, on (N, 1, 6, 6) images."""

    def __init__(self, c_out: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(12, 5)
        self.head = nn.Linear(5, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(torch.tanh(self.fc(nn.functional.avg_pool2d(h, 2).flatten(1))))


def small_cnn(c_out: int = 3, dtype=torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = SmallCNN(c_out).to(dtype)
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 1, 6, 6, dtype=dtype))
    net.bn.weight.data.uniform_(0.5, 1.5)
    net.bn.bias.data.uniform_(-0.5, 0.5)
    return net.eval()


def mlp(d_in=3, width=6, d_out=1, depth=2, dtype=torch.float64, seed=0, activation=nn.Tanh) -> nn.Module:
    torch.manual_seed(seed)
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), activation()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers).to(dtype)


def mean_field_draws(net: nn.Module, q, x: torch.Tensor, num_samples: int, seed: int) -> torch.Tensor:
    """``f(x; μ + s ⊙ ε)`` for ``num_samples`` draws ``ε`` from a generator seeded with ``seed``, one tensor per
    parameter in ``q.names`` order (as a mean-field Gaussian draws them), by ``functional_call``: ``(S, N, C)``."""
    g = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(num_samples):
        theta = {n: (m + s * torch.randn(m.shape, generator=g, dtype=m.dtype)).detach()
                 for n, m, s in zip(q.names, q.mean, q.stds().values())}
        draws.append(functional_call(net, theta, (x,)))
    return torch.stack(draws)


def random_like(params: dict[str, torch.Tensor], scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}


def random_variances(params: dict[str, torch.Tensor], seed: int = 2) -> dict[str, torch.Tensor]:
    """Element-wise variances in [0.1, 1.1], different for every weight."""
    g = torch.Generator().manual_seed(seed)
    return {n: 0.1 + torch.rand(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}


def check_directional_derivatives(fn, params, groups, directions: int, generator: torch.Generator, h: float = 1e-5,
                                  rtol: float = 1e-6, atol: float = 1e-8) -> None:
    """Autograd's ``∂fn/∂params`` against central differences along ``directions`` random directions per group
    of parameter indices (every parameter of the group moves; the parameters are restored afterwards)."""
    grads = torch.autograd.grad(fn(), params)
    base = [p.detach().clone() for p in params]
    for group in groups:
        for _ in range(directions):
            d = {i: torch.randn(base[i].shape, generator=generator, dtype=base[i].dtype) for i in group}
            values = []
            for sign in (1, -1):
                with torch.no_grad():
                    for i in group:
                        params[i].copy_(base[i] + sign * h * d[i])
                    values.append(fn())
            with torch.no_grad():
                for i in group:
                    params[i].copy_(base[i])
            numeric = (values[0] - values[1]) / (2 * h)
            torch.testing.assert_close(sum((grads[i] * d[i]).sum() for i in group), numeric, rtol=rtol, atol=atol)
