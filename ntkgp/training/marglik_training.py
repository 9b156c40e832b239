"""Online marginal-likelihood training (Immer et al. 2021, Algorithm 1)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gpytorch.likelihoods import Likelihood
from torch import nn
from tqdm.auto import tqdm

from ..curvature import compute_curvature
from ..kernels import NTKKernel
from ..likelihoods import hyperparameter_values, log_likelihood, num_outputs, validate_targets
from ..mlls.laplace_ggn_evidence import laplace_ggn_evidence
from ..models import NTKGP
from ..ntk import GroupSpec

STRUCTURES = ("full", "kfac", "diag_ggn", "diag_ef")


@dataclass
class MarglikResult:
    """What :func:`train_marglik` returns.

    Attributes:
        net: the trained network (the one passed in, at its best-evidence checkpoint).
        kernel: an :class:`~ntkgp.NTKKernel` carrying the learned prior precisions.
        likelihood: the likelihood with the learned noise / temperature.
        log_evidence: the best evidence, divided by N.
        best_epoch: the epoch of the best checkpoint.
        history: one dict per hyperparameter round: ``epoch``, ``log_evidence`` (/N), ``prior_precision``,
            the likelihood hyperparameters, and ``train_loss`` (the MAP objective per data point).
        train_loss: the MAP objective per data point, per epoch.
    """

    net: nn.Module
    kernel: NTKKernel
    likelihood: Likelihood
    log_evidence: float
    best_epoch: int
    history: list[dict] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)

    @property
    def prior_precision(self) -> torch.Tensor:
        return self.kernel.prior_precision.detach()

    def model(self, train_x: torch.Tensor, train_y: torch.Tensor, **kwargs) -> NTKGP:
        """An :class:`~ntkgp.NTKGP` of the trained network with the learned hyperparameters."""
        return NTKGP(self.net, train_x, train_y, self.likelihood, prior_precision=self.prior_precision,
                     groups=self.kernel.groups_spec, input_shape=self.kernel.engine.input_shape, **kwargs)


def train_marglik(
    net: nn.Module,
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    likelihood: Likelihood,
    *,
    structure: str = "full",
    groups: GroupSpec = "layer",
    prior_precision: float | torch.Tensor = 1.0,
    epochs: int = 500,
    batch_size: int | None = None,
    lr: float = 1e-3,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
    burn_in: int = 50,
    frequency: int = 10,
    hyper_steps: int = 100,
    hyper_lr: float = 0.1,
    learn_likelihood: bool = True,
    curvature_batch_size: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> MarglikResult:
    r"""Train ``net`` on its MAP objective while learning the hyperparameters by the Laplace evidence.

    Algorithm 1 of Immer et al. (2021): minimise :math:`-\log p(D\mid\theta) - \log p(\theta\mid\delta)`
    over :math:`\theta` (the weight decay is the prior, with the current :math:`\delta_g` per group and the
    current noise/temperature in the likelihood). After ``burn_in`` epochs, every ``frequency`` epochs,
    compute the curvature once at the current :math:`\theta^*` and take ``hyper_steps`` Adam steps
    (step ``hyper_lr``) on :math:`-\log q(D)` w.r.t. the prior precisions (per group) and, with
    ``learn_likelihood``, the likelihood's hyperparameters (noise σ, one or per output; a temperature that
    is learnable). The checkpoint with the best evidence is kept and loaded at the end.

    ``net`` **is trained in place** (that is the purpose of this function); nothing else about it (mode,
    dtype, flags) is changed. The data are the tensors given (a seeded shuffle per epoch).

    Args:
        net: the network to train, ``(N, ...) → (N, C)``.
        train_x, train_y: training data.
        likelihood: a supported likelihood (see :mod:`ntkgp.likelihoods`).
        structure: the curvature for the evidence: ``"full"`` (function-space Laplace-GGN, exact; small
            N·C), ``"kfac"``, ``"diag_ggn"``, ``"diag_ef"`` (:func:`ntkgp.curvature.compute_curvature`).
        groups: prior-precision groups.
        prior_precision: initial :math:`\delta`.
        epochs, batch_size, lr, optimizer: the MAP training (``batch_size=None``: full batch).
        burn_in, frequency, hyper_steps, hyper_lr: Algorithm 1's B, F, K and γ.
        curvature_batch_size: examples per batch of the curvature pass.
        progress: a tqdm bar over epochs (with the latest evidence).
    """
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    for name, value in (("epochs", epochs), ("frequency", frequency)):
        if int(value) < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if burn_in < 0 or hyper_steps < 0:
        raise ValueError("burn_in and hyper_steps must be non-negative")
    input_shape = tuple(train_x.shape[1:]) if train_x.dim() > 2 else None
    kernel = NTKKernel(net, prior_precision=prior_precision, groups=groups, input_shape=input_shape,
                       chunk_size=curvature_batch_size)
    engine = kernel.engine
    x = train_x.to(dtype=engine.dtype, device=engine.device) if train_x.is_floating_point() else train_x
    x_flat = x.flatten(1)
    if num_outputs(likelihood) != engine.num_outputs(x):
        raise ValueError(f"net has {engine.num_outputs(x)} outputs but the likelihood expects {num_outputs(likelihood)}")
    y = validate_targets(likelihood, train_y, engine.num_outputs(), num_data=x.shape[0], name="train_y").to(engine.device)
    n = x.shape[0]
    batch = n if batch_size is None else int(batch_size)
    params = dict(net.named_parameters())
    trainable = [params[name] for name in engine.groups.names]
    group_of = engine.groups.group_of
    theta_opt = optimizer(trainable, lr=lr)
    hypers = list(kernel.parameters()) + (list(likelihood.parameters()) if learn_likelihood else [])
    hyper_opt = torch.optim.Adam([p for p in hypers if p.requires_grad], lr=hyper_lr)
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def map_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        delta = kernel.prior_precision.detach()
        fit = log_likelihood(likelihood, net(xb), yb).sum() * (n / xb.shape[0])
        prior = sum(0.5 * delta[g] * p.pow(2).sum() for p, g in zip(trainable, group_of))
        return (prior - fit) / n

    def evidence_fn() -> Callable[[], torch.Tensor]:
        if structure == "full":
            f = engine.outputs(x)
            return lambda: laplace_ggn_evidence(kernel, likelihood, x_flat, f, y)
        curvature = compute_curvature(net, x, y, likelihood, structure=structure, groups=groups,
                                      batch_size=curvature_batch_size, progress=False)
        return lambda: curvature.log_evidence(kernel.prior_precision, likelihood)

    best = {"value": -float("inf"), "epoch": -1, "state": None, "hypers": None}
    history, losses = [], []
    bar = tqdm(range(1, epochs + 1), desc="marglik training", disable=not progress)
    for epoch in bar:
        total = 0.0
        order = torch.randperm(n, generator=generator).to(engine.device)
        for s in range(0, n, batch):
            idx = order[s : s + batch]
            theta_opt.zero_grad()
            loss = map_loss(x[idx], y[idx])
            loss.backward()
            theta_opt.step()
            total += loss.item() * len(idx) / n
        losses.append(total)
        round_due = epoch > burn_in and (epoch - burn_in) % frequency == 0
        if not (round_due or epoch == epochs):
            continue
        evidence = evidence_fn()
        for _ in range(hyper_steps):
            hyper_opt.zero_grad()
            (-evidence()).backward()
            hyper_opt.step()
        with torch.no_grad():
            value = evidence().item() / n
        for p in trainable:
            p.grad = None
        record = {"epoch": epoch, "log_evidence": value, "prior_precision": kernel.prior_precision.detach().tolist(),
                  "train_loss": total, **hyperparameter_values(likelihood)}
        history.append(record)
        bar.set_postfix(log_evidence=f"{value:.4f}")
        if value > best["value"]:
            best.update(value=value, epoch=epoch, state=copy.deepcopy(net.state_dict()),
                        hypers=[p.detach().clone() for p in hypers])
    for p in hypers:
        p.grad = None
    if best["state"] is not None:
        net.load_state_dict(best["state"])
        with torch.no_grad():
            for p, v in zip(hypers, best["hypers"]):
                p.copy_(v)
    return MarglikResult(net=net, kernel=kernel, likelihood=likelihood, log_evidence=best["value"],
                         best_epoch=best["epoch"], history=history, train_loss=losses)
