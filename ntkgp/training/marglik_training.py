"""Online marginal-likelihood training (Immer et al. 2021, Algorithm 1)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.utils.errors import NotPSDError
from torch import nn
from tqdm.auto import tqdm

from ..laplace.weight_space import compute_curvature
from ..distributed import (
    all_gather_rows,
    all_reduce_max,
    all_reduce_sum,
    broadcast_,
    check_distributed,
    check_layout,
    rank,
    together,
)
from ..kernels import NTKKernel
from ..likelihoods import (
    hyperparameter_values,
    is_gaussian,
    likelihood_temperature,
    log_likelihood,
    noise_variance,
    validate_targets,
)
from ..models import NTKGP
from ..ntk import GroupSpec
from ..options import Structure, choose, renamed_argument
from ..laplace.weight_space.posterior import WeightPosterior
from ..laplace.weight_space.full_curvature import exact_curvature, full_curvature

#: The sane range of every prior precision δ_g; outside it training warns and keeps the last sane values.
PRIOR_PRECISION_RANGE = (1e-8, 1e8)
#: The sane range of a Gaussian noise variance σ², relative to the mean variance of the targets.
NOISE_VARIANCE_RANGE = (1e-12, 1e4)
#: The sane range of a learnable temperature T.
TEMPERATURE_RANGE = (1e-4, 1e4)


class HyperparameterWarning(RuntimeWarning):
    """A hyperparameter round of :func:`train_marglik` left the sane range or met a non-finite evidence."""


@dataclass
class MarglikResult:
    """What :func:`train_marglik` returns.

    Attributes:
        net: the trained network (the one passed in, at its best-evidence checkpoint).
        kernel: an :class:`~ntkgp.NTKKernel` carrying the learned prior precisions.
        likelihood: the likelihood with the learned noise / temperature.
        log_evidence: the best log marginal likelihood, divided by N (``-inf`` if no round gave a finite one).
        best_epoch: the epoch of the best checkpoint (``-1`` if none).
        history: one dict per hyperparameter round: ``epoch``, ``log_evidence`` (/N), ``prior_precision``,
            the likelihood's hyperparameters as :func:`~ntkgp.likelihoods.hyperparameter_values` reads them
            (``noise`` and ``task_noises`` hold the noise **variances** σ², ``temperature`` T), and
            ``train_loss`` (the MAP objective per data point).
        train_loss: the MAP objective per data point, per epoch.
        structure: the curvature structure the hyperparameters were learned with
            (:class:`ntkgp.options.Structure` value).

    The predictive of the structure that was trained is :meth:`posterior` (a weight-space Laplace posterior,
    for :func:`ntkgp.laplace.predict`); :meth:`model` is the function-space GP of the full GGN (exact GLM
    predictive), whatever the structure.
    """

    net: nn.Module
    kernel: NTKKernel
    likelihood: Likelihood
    log_evidence: float
    best_epoch: int
    history: list[dict] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    structure: str = "full_ggn"

    @property
    def prior_precision(self) -> torch.Tensor:
        """The learned prior precisions δ, ``(G,)``."""
        return self.kernel.prior_precision.detach()

    @property
    def log_marginal_likelihood(self) -> float:
        """The best log marginal likelihood per data point (same as :attr:`log_evidence`)."""
        return self.log_evidence

    def model(self, train_x: torch.Tensor, train_y: torch.Tensor, **kwargs) -> NTKGP:
        """An :class:`~ntkgp.NTKGP` of the trained network with the learned hyperparameters: the GP of the
        **full GGN** (its evidence and GLM predictive are exact). For ``structure="full_ggn"`` that is the
        trained structure; for the others use :meth:`posterior`."""
        return NTKGP(self.net, train_x, train_y, self.likelihood, prior_precision=self.prior_precision,
                     prior_structure=self.kernel.prior_structure, input_shape=self.kernel.engine.input_shape, **kwargs)

    def posterior(self, train_x: torch.Tensor, train_y: torch.Tensor | None, **kwargs) -> WeightPosterior:
        r"""The weight-space Laplace posterior of the **structure that was trained** (``"full_ggn"`` /
        ``"full_ef"``: :class:`~ntkgp.laplace.weight_space.FullLaplace`; ``"kfac"``: :class:`~ntkgp.laplace.weight_space.KFACLaplace`
        without damping, as the training evidence; ``"diag_ggn"`` / ``"diag_ef"``:
        :class:`~ntkgp.laplace.weight_space.DiagLaplace`) with the learned :math:`\delta` and the learned likelihood:
        its ``log_det_precision`` is the one of the training evidence, and
        ``ntkgp.laplace.predict(result.posterior(x, y), x_test)`` its predictive
        (:func:`ntkgp.laplace.laplace_posterior`; ``kwargs`` are passed to it)."""
        from ..laplace.weight_space.laplace_posterior import laplace_posterior

        kwargs.setdefault("input_shape", self.kernel.engine.input_shape)
        return laplace_posterior(self.net, train_x, train_y, self.likelihood, structure=self.structure,
                                 prior_precision=self.prior_precision, prior_structure=self.kernel.prior_structure,
                                 **kwargs)


def _positive_int(value: object, argument: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{argument} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_float(value: object, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{argument} must be a positive finite number, got {value!r}")
    return float(value)


def _curvature(net, x, y, likelihood, structure, prior_structure, batch_size, input_shape, distributed=False,
               spectral=False, engine=None):
    """The curvature of one round at the current θ*, built once; its evidence is then cheap to re-evaluate.

    The full structures are exact, in the cheaper space (:func:`ntkgp.laplace.weight_space.full_curvature.exact_curvature`; with
    ``distributed``, weight space summed over the ranks); the scalable ones through ``compute_curvature``."""
    if structure in (Structure.FULL_GGN, Structure.FULL_EF):
        kind = "ggn" if structure is Structure.FULL_GGN else "ef"
        if distributed:
            return full_curvature(net, x, y, likelihood, kind, prior_structure, batch_size, False, input_shape,
                                  distributed, spectral)
        return exact_curvature(net, x, y, likelihood, kind, prior_structure, batch_size, input_shape, spectral,
                               engine=engine, validated=engine is not None)
    return compute_curvature(net, x, y, likelihood, structure=structure.value, prior_structure=prior_structure,
                             batch_size=batch_size, progress=False, input_shape=input_shape, distributed=distributed)


def _out_of_range(model: NTKGP, target_variance: float) -> list[str]:
    """Descriptions of the hyperparameters outside their sane ranges (empty when all are sane)."""
    problems = []
    delta = model.covar_module.prior_precision.detach()
    low, high = PRIOR_PRECISION_RANGE
    if not (torch.isfinite(delta).all() and (delta >= low).all() and (delta <= high).all()):
        problems.append(f"prior precision δ = {[float(f'{v:.3g}') for v in delta.tolist()]} left [{low:g}, {high:g}]")
    lik = model.likelihood
    if is_gaussian(lik):
        var = noise_variance(lik).detach()
        low, high = (r * target_variance for r in NOISE_VARIANCE_RANGE)
        if not (torch.isfinite(var).all() and (var >= low).all() and (var <= high).all()):
            problems.append(f"noise variance σ² = {[float(f'{v:.3g}') for v in var.tolist()]} left [{low:.3g}, {high:.3g}]")
    temperature = likelihood_temperature(lik)
    if temperature is not None:
        t = temperature.detach()
        low, high = TEMPERATURE_RANGE
        if not (torch.isfinite(t).all() and (t >= low).all() and (t <= high).all()):
            problems.append(f"temperature T = {t.tolist()} left [{low:g}, {high:g}]")
    return problems


def train_marglik(
    net: nn.Module,
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    likelihood: Likelihood,
    *,
    structure: str = "full_ggn",
    prior_structure: GroupSpec = "layer",
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
    distributed: bool = False,
    **kwargs,
) -> MarglikResult:
    r"""Train ``net`` on its MAP objective while learning the hyperparameters by the Laplace evidence.

    Algorithm 1 of Immer et al. (2021): minimize :math:`-\log p(D\mid\theta) - \log p(\theta\mid\delta)`
    over :math:`\theta` with ``optimizer`` (the weight decay is the prior, with the current :math:`\delta_g`
    per group and the current noise/temperature in the likelihood) on batches of ``batch_size`` examples
    (``None``: the full batch, one step per epoch). After ``burn_in`` epochs, every ``frequency`` epochs (and
    after the last), compute the curvature once at the current :math:`\theta^*` and take ``hyper_steps``
    Adam steps (step ``hyper_lr``) on :math:`-\log q(D)` w.r.t. the prior precisions (per group) and, with
    ``learn_likelihood``, the likelihood's hyperparameters (noise, one or per output; a learnable
    temperature). The checkpoint with the best evidence is kept and loaded at the end.

    **Cost.** Every round builds the curvature **once** at the current :math:`\theta^*` and every
    hyperparameter step re-evaluates the evidence from it. The full structures are exact
    (:func:`ntkgp.laplace.weight_space.full_curvature.exact_curvature`): in function space, the per-group NTK Grams of the
    structured route and one :math:`R \times R` Cholesky factorization per step (:math:`R = NC` for the GGN,
    :math:`N` for the EF), when :math:`R < P`; in weight space, the :math:`P \times P` components and one
    :math:`P \times P` factorization per step otherwise. With a single prior precision (``prior_structure=
    "network"``) and ``hyper_steps >= 3``, one eigendecomposition per round makes every step :math:`O(\min(R,
    P))`. The evidence of a round is the one evaluated by its last step, at the hyperparameters before that
    step's update (recorded in ``history`` and kept with a checkpoint together), so ``hyper_steps=1`` costs
    one factorization and its gradient per round. The value equals :meth:`ntkgp.NTKGP.log_marginal_likelihood`
    of the network (``curvature="ggn"`` / ``"ef"``). The scalable structures go through
    :func:`ntkgp.laplace.compute_curvature`. With ``frequency=1`` (the paper's F = 1) θ changes every
    epoch, so the curvature is built every epoch: :math:`O(R^2 P)` work against :math:`O(NP)` for a
    full-batch MAP step (docs/training.md, "Measured").

    **Safeguards.** All inputs are validated before the network is touched. A hyperparameter round stops
    early, restores the last sane hyperparameters and warns (:class:`HyperparameterWarning`) when the
    evidence becomes non-finite, the factorization fails, or a hyperparameter leaves its sane range
    (:data:`PRIOR_PRECISION_RANGE`, :data:`NOISE_VARIANCE_RANGE` relative to the targets' variance,
    :data:`TEMPERATURE_RANGE`): a too large ``hyper_lr`` cannot run away silently. When the MAP training
    itself diverges (a non-finite loss or weights after an epoch: a too large ``lr``), training stops, the best
    checkpoint so far is loaded and a :class:`HyperparameterWarning` says so; before any round with a finite
    evidence, the network's initial weights are restored and ``FloatingPointError`` is raised.

    ``net`` **is trained in place** (that is the purpose of this function); nothing else about it (mode,
    dtype, flags) is changed. The data are the tensors given (a seeded shuffle per epoch).

    Args:
        net: the network to train, ``(N, ...) → (N, C)``.
        train_x: training inputs ``(N, ...)`` (every row is checked for NaN/Inf before training).
        train_y: training targets.
        likelihood: a supported likelihood (see :mod:`ntkgp.likelihoods`).
        structure: the curvature of the evidence (:class:`ntkgp.options.Structure`): ``"full_ggn"``
            (function-space Laplace-GGN, exact; ``"full"`` is its deprecated name), ``"full_ef"`` (the full
            empirical Fisher), ``"kfac"``, ``"diag_ggn"``, ``"diag_ef"``.
        prior_structure: prior-precision groups (``groups=`` is its deprecated name).
        prior_precision: initial :math:`\delta`.
        epochs: number of epochs.
        batch_size: examples per MAP step (``None``: full batch).
        lr: learning rate of the MAP optimizer.
        optimizer: the MAP optimizer's class (called as ``optimizer(params, lr=lr)``).
        burn_in: Algorithm 1's B (epochs before the first round).
        frequency: Algorithm 1's F (epochs between rounds).
        hyper_steps: Algorithm 1's K (Adam steps per round).
        hyper_lr: Algorithm 1's γ (Adam step size on the hyperparameters).
        learn_likelihood: also learn the likelihood's hyperparameters.
        curvature_batch_size: examples per batch of the curvature pass.
        seed: seed of the per-epoch shuffle.
        progress: a tqdm bar over epochs (with the latest evidence); rank 0 only with ``distributed``.
        distributed: data-parallel over an initialized ``torch.distributed`` process group, as
            ``DistributedDataParallel``: every rank makes the same call with its shard of the data
            (:func:`ntkgp.distributed.shard`); the network's weights and buffers are first broadcast from
            rank 0; each MAP step sums the gradients of every rank's batch (``batch_size`` is per rank; the
            ranks take the same number of steps per epoch, a rank that runs out of batches contributing
            nothing); the evidence's sums over the data are all-reduced (the full structures in weight
            space, :mod:`~ntkgp.training.weight_space`); every rank ends with the same weights and
            hyperparameters, those of one process on all the data for ``batch_size=None``
            (docs/scaling.md, "Several processes and GPUs").

    Returns:
        A :class:`MarglikResult`.

    Raises:
        ValueError: for any invalid argument (named), before any training.
        FloatingPointError: the MAP training diverged before any round had a finite evidence (the network's
            initial weights are restored).
    """
    prior_structure = renamed_argument(kwargs, "groups", "prior_structure", prior_structure, "layer")
    if kwargs:
        raise TypeError(f"train_marglik got unexpected keyword arguments {sorted(kwargs)}")
    structure = choose(Structure, structure, "structure")
    epochs = _positive_int(epochs, "epochs")
    frequency = _positive_int(frequency, "frequency")
    burn_in = _positive_int(burn_in, "burn_in", 0)
    hyper_steps = _positive_int(hyper_steps, "hyper_steps", 0)
    curvature_batch_size = _positive_int(curvature_batch_size, "curvature_batch_size")
    seed = _positive_int(seed, "seed", 0)
    if batch_size is not None:
        batch_size = _positive_int(batch_size, "batch_size")
    lr = _positive_float(lr, "lr")
    hyper_lr = _positive_float(hyper_lr, "hyper_lr")
    if not callable(optimizer):
        raise TypeError(f"optimizer must be an optimizer class (callable), got {optimizer!r}")
    if not isinstance(learn_likelihood, bool) or not isinstance(progress, bool):
        raise TypeError("learn_likelihood and progress must be bools")
    distributed = check_distributed(distributed)
    state = [*net.parameters(), *net.buffers()]
    check_layout(state, "the network's weights", enabled=distributed)  # a broadcast of mismatched sizes aborts
    broadcast_(state, enabled=distributed)  # replicated, as DDP does
    # Builds the kernel and checks every row of train_x, the outputs and the targets: no side effect on net.
    with together("checking the training data", distributed):
        model = NTKGP(net, train_x, train_y, likelihood, prior_precision=prior_precision,
                      prior_structure=prior_structure, chunk_size=curvature_batch_size)
    model.train()
    engine = model.covar_module.engine
    x_flat = model.train_x
    x = engine.prepare(x_flat, "train_x")
    y = model.train_y
    # the targets in the likelihood's normal form, checked once, for the curvature of every round
    y_curvature = validate_targets(likelihood, y, engine.num_outputs(x), num_data=x.shape[0])
    n_local = x.shape[0]
    n = int(all_reduce_sum(torch.tensor([n_local], device=engine.device), distributed).item())
    batch = n_local if batch_size is None else min(batch_size, n_local)
    steps = all_reduce_max(-(-n_local // batch), distributed)  # MAP steps per epoch, the same on every rank
    full_batch = batch >= n_local
    target_variance = 1.0
    if is_gaussian(likelihood):
        y_all = all_gather_rows(y.to(x.dtype), distributed)  # one dtype on every rank
        target_variance = max(float(y_all.var(dim=0, unbiased=False).mean()) if n > 1 else 1.0, 1e-12)

    params = dict(net.named_parameters())
    trainable = [params[name] for name in engine.groups.names]
    group_of = engine.groups.group_of
    theta_opt = optimizer(trainable, lr=lr)
    hypers = list(model.covar_module.parameters()) + (list(likelihood.parameters()) if learn_likelihood else [])
    hypers = [p for p in hypers if p.requires_grad]
    broadcast_(hypers, enabled=distributed)

    def new_hyper_optimizer() -> torch.optim.Optimizer:
        return torch.optim.Adam(hypers, lr=hyper_lr)

    hyper_opt = new_hyper_optimizer()
    generator = torch.Generator(device="cpu").manual_seed(seed)

    # ½ δ_g per trainable tensor, as Python floats: read once per hyperparameter round, not per MAP step
    half_delta: list[float] = []

    def refresh_prior() -> None:
        delta = model.covar_module.prior_precision.detach().tolist()
        half_delta[:] = [0.5 * delta[g] for g in group_of]

    refresh_prior()

    def map_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        fit = log_likelihood(likelihood, net(xb), yb).sum() * (n / xb.shape[0])
        prior = sum(w * p.square().sum() for p, w in zip(trainable, half_delta))
        return (prior - fit) / n

    def distributed_step(idx: torch.Tensor) -> float:
        """One MAP step on every rank's batch: the data term's gradients summed over the ranks (as DDP)."""
        theta_opt.zero_grad()
        fit = torch.zeros((), dtype=x.dtype, device=x.device)
        if len(idx):
            fit = log_likelihood(likelihood, net(x[idx]), y[idx]).sum()
            (-fit).backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in trainable]
        sums = torch.stack([fit.detach(), torch.tensor(float(len(idx)), dtype=x.dtype, device=x.device)])
        all_reduce_sum(grads + [sums])
        fit_sum, count = sums.tolist()
        delta = model.covar_module.prior_precision.detach()
        prior = sum(0.5 * delta[g] * p.pow(2).sum() for p, g in zip(trainable, group_of)) / n
        for p, grad in zip(trainable, grads):
            p.grad = grad / count  # ∇ of -fit · (n / B) / n
        prior.backward()
        theta_opt.step()
        return (prior.item() - fit_sum / count) * count / n

    # One eigendecomposition per round instead of a factorization per step pays from a few steps on
    # (an eigendecomposition costs about as much as three Cholesky factorizations with their gradients).
    spectral = engine.groups.num_groups == 1 and hyper_steps >= 3

    def evidence_fn() -> Callable[[], torch.Tensor]:
        curv = _curvature(net, x, y_curvature, likelihood, structure, prior_structure, curvature_batch_size,
                          engine.input_shape, distributed, spectral, engine)
        evaluate = curv.log_marginal_likelihood
        return lambda: evaluate(model.covar_module.prior_precision, likelihood)

    best = {"value": -float("inf"), "epoch": -1, "state": None, "hypers": None}
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}  # restored if MAP training diverges
    history, losses = [], []
    bar = tqdm(range(1, epochs + 1), desc="marglik training", disable=not progress or rank() != 0)
    for epoch in bar:
        total = 0.0
        order = None if full_batch and not distributed else torch.randperm(n_local, generator=generator).to(engine.device)
        for step in range(steps if distributed else 0):
            total += distributed_step(order[step * batch : (step + 1) * batch])
        for s in range(0, n if not distributed else 0, batch):
            idx = None if order is None else order[s : s + batch]
            theta_opt.zero_grad()
            loss = map_loss(x, y) if full_batch else map_loss(x[idx], y[idx])  # full batch: no copy
            loss.backward()
            theta_opt.step()
            total += loss.item() * (n if idx is None else len(idx)) / n
        losses.append(total)
        if not (math.isfinite(total) and all(bool(torch.isfinite(p).all()) for p in trainable)):
            where = (f"the checkpoint of epoch {best['epoch']} (the best evidence) is loaded" if best["state"] is not
                     None else "no round had a finite evidence yet: the network's initial weights are restored")
            message = (f"train_marglik, epoch {epoch}: the MAP training diverged (a non-finite loss or weights; is "
                       f"lr={lr:g} too large?); training stopped and {where}")
            if best["state"] is None:
                net.load_state_dict(initial)
                raise FloatingPointError(message)
            warnings.warn(message, HyperparameterWarning, stacklevel=2)
            break
        round_due = epoch > burn_in and (epoch - burn_in) % frequency == 0
        if not (round_due or epoch == epochs):
            continue
        evidence = evidence_fn()
        sane = [p.detach().clone() for p in hypers]
        problem, value = None, None
        for _ in range(hyper_steps):
            hyper_opt.zero_grad()
            try:
                objective = -evidence()
            except NotPSDError as error:
                problem = f"the evidence could not be factorized ({error})"
                break
            if not torch.isfinite(objective):
                problem = "the evidence became non-finite"
                break
            objective.backward()
            # the round's evidence is the last one evaluated, at the hyperparameters before this step: an
            # exact (θ*, hyperparameters, evidence) triple without another factorization
            value, at = -objective.item() / n, sane
            hyper_opt.step()
            out = _out_of_range(model, target_variance)
            if out:
                problem = "; ".join(out)
                break
            sane = [p.detach().clone() for p in hypers]
        if problem is not None:
            with torch.no_grad():
                for p, v in zip(hypers, sane):
                    p.copy_(v)
            hyper_opt = new_hyper_optimizer()
            warnings.warn(
                f"train_marglik, epoch {epoch}: {problem}; the hyperparameters were reset to their last sane values "
                f"(is hyper_lr={hyper_lr:g} too large?)",
                HyperparameterWarning,
                stacklevel=2,
            )
        broadcast_(hypers, enabled=distributed)  # the ranks computed the same steps; make it exact
        if value is None or problem is not None:
            try:
                with torch.no_grad():
                    value = evidence().item() / n
            except NotPSDError:
                value = float("nan")
            at = [p.detach().clone() for p in hypers]
        for p in trainable:
            p.grad = None
        current = [p.detach().clone() for p in hypers]
        with torch.no_grad():  # the record shows the hyperparameters the evidence was evaluated at
            for p, v in zip(hypers, at):
                p.copy_(v)
            record = {"epoch": epoch, "log_evidence": value,
                      "prior_precision": model.covar_module.prior_precision.detach().tolist(), "train_loss": total,
                      **hyperparameter_values(likelihood)}
            for p, v in zip(hypers, current):
                p.copy_(v)
        history.append(record)
        refresh_prior()
        if progress:
            bar.set_postfix(log_evidence=f"{value:.4f}")
        if math.isfinite(value) and value > best["value"]:
            best.update(value=value, epoch=epoch, state={k: v.detach().clone() for k, v in net.state_dict().items()},
                        hypers=at)
    for p in hypers:
        p.grad = None
    if best["state"] is not None:
        net.load_state_dict(best["state"])
        with torch.no_grad():
            for p, v in zip(hypers, best["hypers"]):
                p.copy_(v)
    else:
        warnings.warn("train_marglik: no hyperparameter round gave a finite evidence", HyperparameterWarning, stacklevel=2)
    return MarglikResult(net=net, kernel=model.covar_module, likelihood=likelihood, log_evidence=best["value"],
                         best_epoch=best["epoch"], history=history, train_loss=losses, structure=structure.value)
