"""Online marginal-likelihood training (Immer et al. 2021, Algorithm 1): the public entry point.

The parts live beside it, one concept each: :mod:`~ntkgp.training.arguments` (the options, checked first),
:mod:`~ntkgp.training.data` (tensors or a loader, checked in full), :mod:`~ntkgp.training.map_training` (the MAP
epochs), :mod:`~ntkgp.training.hyper_round` (the hyperparameter rounds), :mod:`~ntkgp.training.checkpoint`
(the best checkpoint, the initial state and the user's gradients), :mod:`~ntkgp.training.safeguards` (the sane
ranges) and :mod:`~ntkgp.training.result` (what is returned).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from gpytorch.likelihoods import Likelihood
from torch import nn

from ..distributed import broadcast_, check_layout, rank
from ..ntk import GroupSpec
from ..ntk.outputs import with_output
from ..option_groups import accepts_flat_keywords, check_group
from ..progress import Progress
from ..validation import flag
from .arguments import MarglikOptions, check_options, make_optimizer, make_scheduler
from .checkpoint import Checkpoints
from .data import LoaderData, TensorData, structured_data, training_data
from .hyper_round import HyperparameterRound, build_curvature
from .map_training import MapTraining, step_scheduler
from .marglik_options import HyperparameterSchedule, MAPOptimization
from .normalization import batch_statistics
from .result import MarglikResult
from .safeguards import (
    NOISE_VARIANCE_RANGE,
    PRIOR_PRECISION_RANGE,
    TEMPERATURE_RANGE,
    HyperparameterWarning,
)

__all__ = [
    "NOISE_VARIANCE_RANGE",
    "PRIOR_PRECISION_RANGE",
    "TEMPERATURE_RANGE",
    "HyperparameterWarning",
    "MarglikResult",
    "train_marglik",
]


@accepts_flat_keywords(schedule=HyperparameterSchedule, optimization=MAPOptimization)
def train_marglik(
    net: nn.Module,
    train_x: torch.Tensor | Iterable[tuple[torch.Tensor, torch.Tensor]],
    train_y: torch.Tensor | None,
    likelihood: Likelihood,
    *,
    structure: str = "full_ggn",
    prior_structure: GroupSpec = "layer",
    prior_precision: float | torch.Tensor = 1.0,
    epochs: int = 500,
    batch_size: int | None = None,
    lr: float = 1e-3,
    schedule: HyperparameterSchedule | None = None,
    optimization: MAPOptimization | None = None,
    progress: bool | None = None,
    distributed: bool = False,
    output: str | int | None = None,
) -> MarglikResult:
    r"""Train ``net`` on its MAP objective while learning the hyperparameters by the Laplace evidence.

    Algorithm 1 of Immer et al. (2021): minimize :math:`-\log p(D\mid\theta) - \log p(\theta\mid\delta)`
    over :math:`\theta` with ``optimization.optimizer`` (the weight decay is the prior, with the current :math:`\delta_g`
    per group and the current noise/temperature in the likelihood) on batches of ``batch_size`` examples
    (``None``: the full batch, one step per epoch) or the batches of a loader. On the ``schedule``
    (:class:`~ntkgp.training.HyperparameterSchedule`): after ``burn_in`` epochs, every ``frequency`` epochs (and
    after the last), compute the curvature once at the current :math:`\theta^*` and take ``hyper_steps`` Adam
    steps (step ``hyper_lr``) on :math:`-\log q(D)` w.r.t. the prior precisions (per group) and, with
    ``learn_likelihood``, the likelihood's hyperparameters (noise, one or per output; a
    learnable temperature). The checkpoint with the best evidence is kept and loaded at the end.

    **Cost.** Every round builds the curvature **once** at the current :math:`\theta^*` and every
    hyperparameter step re-evaluates the evidence from it. The full structures are exact
    (:func:`ntkgp.laplace.ggn.full_curvature.exact_curvature`): in function space, the per-group NTK Grams of the
    structured route and one :math:`R \times R` Cholesky factorization per step (:math:`R = NC` for the GGN,
    :math:`N` for the EF), when :math:`R < P`; in weight space, the :math:`P \times P` components and one
    :math:`P \times P` factorization per step otherwise. With a single prior precision (``prior_structure=
    "network"``) and ``hyper_steps >= 3``, one eigendecomposition per round makes every step :math:`O(\min(R,
    P))`. The evidence of a round is the one evaluated by its last step, at the hyperparameters before that
    step's update (recorded in ``history`` and kept with a checkpoint together), so ``hyper_steps=1`` costs
    one factorization and its gradient per round. The value equals :meth:`ntkgp.NTKGP.log_marginal_likelihood`
    of the network (``curvature="ggn"`` / ``"ef"``). The scalable structures go through
    :func:`ntkgp.laplace.compute_curvature` (a loader's batches streamed). With ``frequency=1`` (the paper's
    F = 1) θ changes every epoch, so the curvature is built every epoch (docs/training.md, "Measured").

    **Safeguards.** All inputs are validated before the network is touched (a loader is read once to check
    every batch). A hyperparameter round stops early, restores the last sane hyperparameters and warns
    (:class:`HyperparameterWarning`) when the evidence becomes non-finite, the factorization fails, or a
    hyperparameter leaves its sane range (:data:`PRIOR_PRECISION_RANGE`, :data:`NOISE_VARIANCE_RANGE` relative
    to the targets' variance, :data:`TEMPERATURE_RANGE`): a too large ``hyper_lr`` cannot run away silently.
    When the MAP training itself diverges (a non-finite loss or weights after an epoch: a too large ``lr``),
    training stops, the best checkpoint so far is loaded and a :class:`HyperparameterWarning` says so; before
    any round with a finite evidence, the network's initial weights are restored and ``FloatingPointError``
    is raised.

    **Interrupts.** A ``KeyboardInterrupt`` (Ctrl-C, a SIGINT) or any other exception during training leaves
    the network and the hyperparameters (prior precisions, the likelihood's noise / temperature) at the best
    checkpoint so far, together, or at their initial values before any round had a finite evidence; the
    exception propagates. A ``KeyboardInterrupt`` carries the :class:`MarglikResult` of that state as its
    ``marglik_result`` attribute (the kernel with the prior precisions, the history so far).

    ``net`` **is trained in place** (that is the purpose of this function); nothing else about it (mode,
    dtype, flags) is changed, and every parameter's ``.grad`` (the network's and the likelihood's) is, when
    this function returns or raises, the object the caller left there (``None`` stays ``None``).

    Args:
        net: the network to train, ``(N, ...) → (N, C)``, on the device of the data it is given.
        train_x: training inputs ``(N, ...)`` (every row is checked for NaN/Inf before training) or a dict/tuple of
            tensors (docs/networks.md, "Dict and tuple inputs in the GPyTorch models"), or a re-iterable loader of ``(x, y)`` batches (a ``torch.utils.data.DataLoader``, shuffled or not, of any
            size: its batches are the mini-batches, moved to the network's device).
        train_y: training targets; ``None`` with a loader.
        likelihood: a supported likelihood (see :mod:`ntkgp.likelihoods`).
        structure: the curvature of the evidence (:class:`ntkgp.options.Structure`): ``"full_ggn"``
            (function-space Laplace-GGN, exact), ``"full_ef"`` (the full empirical Fisher), ``"kfac"``,
            ``"diag_ggn"``, ``"diag_ef"``. With a loader the full structures gather the batches into tensors once
            per round (their Grams couple every pair of points); the others stream them.
        prior_structure: prior-precision groups.
        prior_precision: initial :math:`\delta`.
        epochs: number of epochs.
        batch_size: examples per MAP step for tensors (``None``: full batch); ``None`` with a loader.
        lr: learning rate of the MAP optimizer.
        schedule: the hyperparameter rounds, a :class:`~ntkgp.training.HyperparameterSchedule` (``burn_in``,
            ``frequency``, ``hyper_steps``, ``hyper_lr``, ``learn_likelihood``, ``curvature_batch_size``;
            ``None``: its defaults). Its fields as flat keywords (``burn_in=10``) still work, with a
            ``FutureWarning``, for one release.
        optimization: the MAP steps, a :class:`~ntkgp.training.MAPOptimization` (``optimizer``, ``scheduler``,
            ``seed``, ``train_normalization``; ``None``: its defaults); its fields as flat keywords likewise.
        progress: over the epochs (a bar shows the latest evidence): ``None`` (auto: a bar on a terminal, else one
            line with a long training's estimated time), ``True`` (a bar) or ``False`` (silent): :mod:`ntkgp.progress`;
            rank 0 only with ``distributed``.
        distributed: data-parallel over an initialized ``torch.distributed`` process group, as
            ``DistributedDataParallel``: every rank makes the same call with its shard of the data
            (:func:`ntkgp.distributed.shard`, or a loader over its shard); the network's weights and buffers
            are first broadcast from rank 0; each MAP step sums the gradients of every rank's batch
            (``batch_size`` is per rank; the ranks take the same number of steps per epoch, a rank that runs
            out of batches contributing nothing); the evidence's sums over the data are all-reduced (the full
            structures in weight space, :func:`ntkgp.laplace.ggn.full_curvature.full_curvature`); every rank ends with the
            same weights and hyperparameters, those of one process on all the data for ``batch_size=None``
            (docs/scaling.md, "Several processes and GPUs").
        output: for a network returning a dict or a tuple, the key or index of the output to train and use
            (:mod:`ntkgp.ntk.outputs`).

    Returns:
        A :class:`MarglikResult`.

    Raises:
        TypeError, ValueError: for any invalid argument (named), before any training.
        FloatingPointError: the MAP training diverged before any round had a finite evidence (the network's
            initial weights and the initial hyperparameters are restored).
        KeyboardInterrupt: training was interrupted (see "Interrupts").
    """
    schedule = check_group(schedule, HyperparameterSchedule, "schedule")
    optimization = check_group(optimization, MAPOptimization, "optimization")
    train_normalization = flag(optimization.train_normalization, "train_normalization")
    options = check_options(
        train_x, train_y, structure=structure, prior_structure=prior_structure, epochs=epochs, batch_size=batch_size,
        lr=lr, optimizer=optimization.optimizer, scheduler=optimization.scheduler, burn_in=schedule.burn_in,
        frequency=schedule.frequency, hyper_steps=schedule.hyper_steps, hyper_lr=schedule.hyper_lr,
        learn_likelihood=schedule.learn_likelihood, curvature_batch_size=schedule.curvature_batch_size,
        seed=optimization.seed, progress=progress, distributed=distributed,
    )
    net = with_output(net, output)  # a network returning a dict or tuple: its output output= (ntkgp.ntk.outputs)
    net, train_x = structured_data(net, train_x, train_y)  # dict/tuple inputs: packed rows (ntkgp.ntk.packed_inputs)
    state = [*net.parameters(), *net.buffers()]
    check_layout(state, "the network's weights", enabled=options.distributed)  # a broadcast of mismatched sizes aborts
    broadcast_(state, enabled=options.distributed)  # replicated, as DDP does
    data = training_data(net, train_x, train_y, likelihood, prior_precision, options)
    return _Algorithm1(net, likelihood, data, options, train_normalization).run()


class _Algorithm1:
    """One run of Algorithm 1 on checked data: the MAP epochs, the rounds, the checkpoints."""

    def __init__(self, net: nn.Module, likelihood: Likelihood, data: TensorData | LoaderData,
                 options: MarglikOptions, train_normalization: bool = True) -> None:
        self.net, self.likelihood, self.data, self.options = net, likelihood, data, options
        self.train_normalization = train_normalization
        kernel = data.kernel
        trainable = MapTraining.trainable_parameters(net, kernel)
        optimizer = make_optimizer(options.optimizer, trainable, options.lr)  # checked: no weight touched yet
        self.scheduler = make_scheduler(options.scheduler, optimizer)
        self.map = MapTraining(net, likelihood, kernel, trainable, optimizer, data.n, options.distributed)
        hypers = list(kernel.parameters()) + (list(likelihood.parameters()) if options.learn_likelihood else [])
        hypers = [p for p in hypers if p.requires_grad]
        broadcast_(hypers, enabled=options.distributed)
        self.rounds = HyperparameterRound(kernel, likelihood, hypers, options.hyper_lr, options.schedule.hyper_steps,
                                          data.n, data.target_variance, options.distributed)
        self.checkpoints = Checkpoints(net, hypers, [*net.parameters(), *likelihood.parameters()])
        self.generator = torch.Generator(device="cpu").manual_seed(options.seed)
        # One eigendecomposition per round instead of a factorization per step pays from a few steps on
        # (an eigendecomposition costs about as much as three Cholesky factorizations with their gradients).
        self.spectral = kernel.engine.groups.num_groups == 1 and options.schedule.hyper_steps >= 3
        self.history: list[dict] = []
        self.losses: list[float] = []
        self.bar = None

    def run(self) -> MarglikResult:
        """Train; on any exception leave the best checkpoint (or the initial state) loaded, and re-raise."""
        self.bar = Progress(self.options.schedule.epochs, "marglik training",
                            self.options.progress if rank() == 0 else False, unit="epoch")
        self.checkpoints.take_grads()
        try:
            for epoch in range(1, self.options.schedule.epochs + 1):
                if not self._epoch(epoch):
                    break
                self.bar.update(1)
            self._finish()
        except BaseException as error:  # KeyboardInterrupt included: nothing is lost, nothing left half-done
            self.checkpoints.load_best_or_initial()
            if isinstance(error, KeyboardInterrupt):
                error.marglik_result = self.result()
            raise
        finally:
            self.map.release_grads()
            self.rounds.release_grads()
            self.checkpoints.restore_grads()
            self.bar.close()
        return self.result()

    def result(self) -> MarglikResult:
        return MarglikResult(net=self.net, kernel=self.data.kernel, likelihood=self.likelihood,
                             log_evidence=self.checkpoints.best_value, best_epoch=self.checkpoints.best_epoch,
                             history=self.history, train_loss=self.losses, structure=self.options.structure.value)

    def _epoch(self, epoch: int) -> bool:
        """One epoch of MAP steps and, when due, a hyperparameter round; ``False``: training stops."""
        with batch_statistics(self.net, self.train_normalization, self.options.distributed):
            total = self.map.epoch(self.data.batches(self.generator))
        self.losses.append(total)
        if not self.map.finite(total):
            self._diverged(epoch)
            return False
        step_scheduler(self.scheduler, total)
        if self.options.schedule.round_due(epoch):
            self._round(epoch, total)
        return True

    def _diverged(self, epoch: int) -> None:
        where = (f"the checkpoint of epoch {self.checkpoints.best_epoch} (the best evidence) is loaded"
                 if self.checkpoints.has_best else
                 "no round had a finite evidence yet: the network's initial weights are restored")
        message = (f"train_marglik, epoch {epoch}: the MAP training diverged (a non-finite loss or weights; is "
                   f"lr={self.options.lr:g} too large?); training stopped and {where}")
        if not self.checkpoints.has_best:
            raise FloatingPointError(message)  # run() restores the initial state
        warnings.warn(message, HyperparameterWarning, stacklevel=5)

    def _round(self, epoch: int, train_loss: float) -> None:
        self.map.release_grads()  # not needed by the round
        curvature = build_curvature(self.net, self.data, self.likelihood, self.options, self.spectral)
        value, at, problem = self.rounds.run(curvature)
        if problem is not None:
            warnings.warn(
                f"train_marglik, epoch {epoch}: {problem}; the hyperparameters were reset to their last sane values "
                f"(is hyper_lr={self.options.hyper_lr:g} too large?)",
                HyperparameterWarning,
                stacklevel=5,
            )
        self.history.append(self.rounds.record(epoch, value, at, train_loss))
        self.map.refresh_prior()
        self.bar.set_postfix(log_evidence=f"{value:.4f}")
        self.checkpoints.offer(value, epoch, at)

    def _finish(self) -> None:
        if self.checkpoints.has_best:
            self.checkpoints.load_best()
        else:
            warnings.warn("train_marglik: no hyperparameter round gave a finite evidence", HyperparameterWarning,
                          stacklevel=4)
