"""FSVI: time per training step against a plain MAP step and a naive FSVI step that forms full Jacobians.

Same network (MLP 784-256-256-10, ReLU), same mini-batch (128 random inputs, 10 classes), float32, one Adam
step each:

* **MAP**: cross-entropy of the mini-batch scaled to N plus the Gaussian prior's ``δ/2 ‖θ‖²``, backward, step.
* **FSVI (ntkgp)**: ``ntkgp.fsvi.FunctionSpaceELBO`` with ``K = 32`` context points: one reparameterized
  forward/backward of the mini-batch, and the function-space KL on ``K·C = 320`` outputs from the structured
  covariance (layer inputs and output gradients; no Jacobian).
* **FSVI (naive)**: the same objective, but both ``J diag(s²) Jᵀ`` and ``J diag(s0²) Jᵀ`` from the full
  ``(K·C) × P`` Jacobian by ``torch.func.vmap(jacrev)``, differentiated through.

Targets (issue): FSVI ≤ 3× MAP and ≤ 0.3× naive. Each variant is warmed up, then timed over ``--steps``
steps, ``--repeats`` times; the best repeat is reported (other processes on the machine inflate the figures).

    python benchmarks/fsvi.py [--steps 20] [--repeats 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from ntkgp.fsvi import FSVI, FunctionSpaceELBO, gaussian_kl
from ntkgp.likelihoods import SoftmaxLikelihood, log_likelihood

N_DATA, BATCH, K, C = 60_000, 128, 32, 10


def network(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, C))
    return net.to(device).eval()


def map_step(net: nn.Module, device: torch.device):
    params = {n: p.detach().clone().requires_grad_() for n, p in net.named_parameters()}
    opt = torch.optim.Adam(params.values(), lr=1e-3)
    x = torch.randn(BATCH, 784, device=device)
    y = torch.randint(C, (BATCH,), device=device)

    def step() -> None:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(functional_call(net, params, (x,)), y) * N_DATA
        loss = loss + 0.5 * sum(p.square().sum() for p in params.values())
        loss.backward()
        opt.step()

    return step


def fsvi_step(net: nn.Module, device: torch.device):
    model = FSVI(net, SoftmaxLikelihood(C), prior_precision=1.0)
    elbo = FunctionSpaceELBO(model, N_DATA)
    opt = torch.optim.Adam(model.variational_distribution.parameters(), lr=1e-3)
    x = torch.randn(BATCH, 784, device=device)
    y = torch.randint(C, (BATCH,), device=device)
    xc = torch.randn(K, 784, device=device)

    def step() -> None:
        opt.zero_grad()
        (-elbo(x, y, xc).value).backward()
        opt.step()

    return step


def naive_step(net: nn.Module, device: torch.device):
    model = FSVI(net, SoftmaxLikelihood(C), prior_precision=1.0)
    q = model.variational_distribution
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    x = torch.randn(BATCH, 784, device=device)
    y = torch.randint(C, (BATCH,), device=device)
    xc = torch.randn(K, 784, device=device)
    prior_var = torch.ones((), device=device)

    def jacobian(params: dict[str, torch.Tensor]) -> torch.Tensor:
        def single(p, xi):
            return functional_call(net, p, (xi.unsqueeze(0),)).squeeze(0)

        jac = vmap(jacrev(single), in_dims=(None, 0))(params, xc)
        return torch.cat([jac[n].reshape(K * C, -1) for n in q.names], dim=1)  # (K·C, P)

    def step() -> None:
        opt.zero_grad()
        theta = q.sample()
        ell = log_likelihood(model.likelihood, functional_call(net, theta, (x,)), y).sum() * (N_DATA / BATCH)
        mu = q.means()
        j = jacobian(mu)
        var = torch.cat([v.reshape(-1) for v in q.variances().values()])
        cov_q, cov_p = (j * var) @ j.T, (j * prior_var) @ j.T
        f_q = functional_call(net, mu, (xc,)).reshape(-1)
        with torch.no_grad():
            f_p = functional_call(net, {n: torch.zeros_like(t) for n, t in mu.items()}, (xc,)).reshape(-1)
        kl = gaussian_kl(f_q, cov_q, f_p, cov_p)
        (-(ell - kl) / N_DATA).backward()
        opt.step()

    return step


def timed(step, steps: int, repeats: int, device: torch.device, warmup: int = 3) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        best = min(best, (time.perf_counter() - t) / steps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-steps", type=int, default=3, help="steps per repeat for the (slow) naive variant")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    net = network(device)
    times = {
        "MAP": timed(map_step(net, device), args.steps, args.repeats, device),
        "FSVI (ntkgp, structured)": timed(fsvi_step(net, device), args.steps, args.repeats, device),
        "FSVI (naive, vmap(jacrev))": timed(naive_step(net, device), args.naive_steps, args.repeats, device, 1),
    }
    print(f"MLP 784-256-256-10, batch {BATCH}, K = {K} context points, float32, {device.type}, "
          f"threads {torch.get_num_threads()}")
    print(f"{'step':<28}{'ms / step':>12}{'× MAP':>8}")
    for name, t in times.items():
        print(f"{name:<28}{1e3 * t:>12.1f}{t / times['MAP']:>8.2f}")
    ratio = times["FSVI (ntkgp, structured)"] / times["FSVI (naive, vmap(jacrev))"]
    print(f"FSVI / naive: {ratio:.3f} (target ≤ 0.3); FSVI / MAP: "
          f"{times['FSVI (ntkgp, structured)'] / times['MAP']:.2f} (target ≤ 3)")


if __name__ == "__main__":
    main()
