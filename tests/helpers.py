"""Independent reference computations and small networks shared by the tests."""

from __future__ import annotations

import copy

import torch
from torch import nn


def mlp(d_in: int = 3, width: int = 7, d_out: int = 1, depth: int = 2, dtype=torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.Tanh()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers).to(dtype)


class SmallCNN(nn.Module):
    """Conv → BatchNorm → ReLU → pooling → Linear, on (N, 1, 6, 6) images."""

    def __init__(self, c_out: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 2 * 2, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(nn.functional.avg_pool2d(h, 2).flatten(1))


def small_cnn(c_out: int = 2, dtype=torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = SmallCNN(c_out).to(dtype)
    net.train()
    with torch.no_grad():  # give the BatchNorm statistics non-trivial values, then freeze them
        for _ in range(3):
            net(torch.randn(16, 1, 6, 6, dtype=dtype))
    net.bn.weight.data.uniform_(0.5, 1.5)
    net.bn.bias.data.uniform_(-0.5, 0.5)
    return net.eval()


def brute_jacobian(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """``J`` (N·C, P) row by row with ``torch.autograd.grad``; columns over trainable parameters in order."""
    net = copy.deepcopy(net)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        f = net(x[i : i + 1])[0]
        for c in range(f.shape[0]):
            grads = torch.autograd.grad(f[c], [p for _, p in named], retain_graph=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, (_, p) in zip(grads, named)]))
    return torch.stack(rows).detach(), [n for n, _ in named]


def column_groups(net: nn.Module, labels: dict[str, int]) -> torch.Tensor:
    """Group index per Jacobian column from a name → group map (independent of ntkgp's grouping code)."""
    cols = [torch.full((p.numel(),), labels[n]) for n, p in net.named_parameters() if p.requires_grad]
    return torch.cat(cols)


def brute_gram(net: nn.Module, x1: torch.Tensor, x2: torch.Tensor, delta: torch.Tensor, labels: dict[str, int]) -> torch.Tensor:
    """``Σ_g δ_g⁻¹ J_g(x1) J_g(x2)ᵀ`` from brute-force Jacobians."""
    j1, _ = brute_jacobian(net, x1)
    j2, _ = brute_jacobian(net, x2)
    w = delta.reciprocal()[column_groups(net, labels)]
    return (j1 * w) @ j2.T


def snapshot(net: nn.Module) -> dict:
    """Everything about a network that ntkgp must leave unchanged."""
    return {
        "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "requires_grad": {n: p.requires_grad for n, p in net.named_parameters()},
        "training": {n: m.training for n, m in net.named_modules()},
        "dtypes": {n: p.dtype for n, p in net.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()},
        "hooks": sum(len(m._forward_hooks) + len(m._backward_hooks) for m in net.modules()),
    }


def assert_unchanged(net: nn.Module, before: dict) -> None:
    after = snapshot(net)
    assert after["requires_grad"] == before["requires_grad"]
    assert after["training"] == before["training"]
    assert after["dtypes"] == before["dtypes"]
    assert after["hooks"] == before["hooks"]
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k
    for k, v in before["grads"].items():
        assert (after["grads"][k] is None) == (v is None), k


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def reference_log_prob(kind: str, f: torch.Tensor, y: torch.Tensor, noise=None, temperature: float = 1.0) -> torch.Tensor:
    """Per-example log p(y|f) from torch.distributions, written independently of ntkgp.likelihoods."""
    if kind == "gaussian":
        return torch.distributions.Normal(f, noise.sqrt()).log_prob(y.reshape(f.shape)).sum(-1)
    if kind == "logistic":
        return torch.distributions.Bernoulli(logits=f[..., 0]).log_prob(y.reshape(-1).to(f)) / temperature
    if kind == "softmax":
        return torch.distributions.Categorical(logits=f).log_prob(y.reshape(-1)) / temperature
    raise ValueError(kind)


def reference_terms(log_prob, f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example g = ∇f log p and Λ = −∇²f log p by autograd."""
    gs, lams = [], []
    for n in range(f.shape[0]):
        def fn(fn_, n=n):
            return log_prob(fn_.unsqueeze(0), y[n : n + 1]).sum()
        gs.append(torch.autograd.functional.jacobian(fn, f[n]))
        lams.append(-torch.autograd.functional.hessian(fn, f[n]))
    return torch.stack(gs), torch.stack(lams)


def dense_laplace(net, x, y, log_prob, delta_cols: torch.Tensor, curvature: str = "ggn") -> dict:
    """The weight-space Laplace-GGN quantities with dense P×P matrices (the reference for ntkgp)."""
    j, _ = brute_jacobian(net, x)
    with torch.no_grad():
        f = net(x)
    n, c = f.shape
    g, lam = reference_terms(log_prob, f, y)
    jn = j.reshape(n, c, -1)
    if curvature == "ggn":
        curv = torch.einsum("ncp,ncd,ndq->pq", jn, lam, jn)
    else:
        grads = torch.einsum("nc,ncp->np", g, jn)
        curv = grads.T @ grads
    h = curv + torch.diag(delta_cols)
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad])
    evidence = (
        log_prob(f, y).sum()
        - 0.5 * (delta_cols * theta**2).sum()
        + 0.5 * delta_cols.log().sum()
        - 0.5 * torch.linalg.slogdet(h)[1]
    )
    grad_joint = torch.einsum("nc,ncp->p", g, jn) - delta_cols * theta
    return {"evidence": evidence, "H": h, "step": torch.linalg.solve(h, grad_joint), "f": f}


def dense_glm_predictive(net, x_test, laplace: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean f(x*) + J*(θ_post − θ*) and covariance J* H⁻¹ J*ᵀ (interleaved), from dense matrices."""
    j, _ = brute_jacobian(net, x_test)
    with torch.no_grad():
        f = net(x_test)
    mean = f.reshape(-1) + j @ laplace["step"]
    cov = j @ torch.linalg.solve(laplace["H"], j.T)
    return mean, cov
