r"""One hyperparameter round of Algorithm 1: the curvature built once at the current :math:`\theta^*`, then K
Adam steps on :math:`-\log q(D)` w.r.t. the prior precisions and the likelihood's hyperparameters.

The round stops early, restores the last sane hyperparameters and restarts its Adam state when the evidence
becomes non-finite, its factorization fails, or a hyperparameter leaves its sane range
(:mod:`~ntkgp.training.safeguards`). The round's evidence is the one its last step evaluated, at the
hyperparameters before that step's update: network, hyperparameters and evidence of a record belong together.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.utils.errors import NotPSDError
from torch import Tensor, nn

from ..laplace.weight_space.structures import STRUCTURE_CLASSES, compute_curvature
from ..laplace.ggn.full_curvature import exact_curvature, full_curvature
from ..distributed import broadcast_
from ..kernels import NTKKernel
from ..likelihoods import hyperparameter_values
from .arguments import MarglikOptions
from .data import LoaderData, TensorData
from .safeguards import out_of_range

__all__ = ["HyperparameterRound", "build_curvature"]


def build_curvature(net: nn.Module, data: TensorData | LoaderData, likelihood: Likelihood, options: MarglikOptions,
                    spectral: bool = False):
    """The curvature of one round at the current θ*, built once; its evidence is then cheap to re-evaluate.

    The structure table (:data:`~ntkgp.laplace.weight_space.structures.STRUCTURE_CLASSES`) says what to build: an
    exact structure in the cheaper space for a round of ``hyper_steps`` steps
    (:func:`ntkgp.laplace.ggn.full_curvature.exact_curvature`, :func:`~ntkgp.laplace.ggn.space.exact_space`; with
    ``distributed``, weight space summed over the ranks), the scalable ones through ``compute_curvature`` (a
    loader's batches streamed)."""
    engine = data.kernel.engine
    structure, batch_size = options.structure, options.curvature_batch_size
    classes = STRUCTURE_CLASSES[structure]
    if classes.exact:
        kind = classes.kind
        if options.distributed:
            x, y = data.curvature_data(stream=True)
            return full_curvature(net, x, y, likelihood, kind, options.prior_structure, batch_size, False,
                                  engine.input_shape, True, spectral)
        x, y = data.curvature_data(stream=False)
        # the rounds' passes are silent; a round of few steps takes the space of the cheaper build
        return exact_curvature(net, x, y, likelihood, kind, options.prior_structure, batch_size, engine.input_shape,
                               spectral, engine=engine, validated=True, progress=False,
                               steps=options.schedule.hyper_steps)
    x, y = data.curvature_data(stream=True)
    return compute_curvature(net, x, y, likelihood, structure=structure.value, prior_structure=options.prior_structure,
                             batch_size=batch_size, progress=False, input_shape=engine.input_shape,
                             distributed=options.distributed)


def _clone(tensors: list[Tensor]) -> list[Tensor]:
    return [p.detach().clone() for p in tensors]


class HyperparameterRound:
    """The K Adam steps of every round on ``hypers`` (its Adam state carried from round to round).

    Args:
        kernel: the kernel holding the prior precisions.
        likelihood: the likelihood.
        hypers: the hyperparameters learned (the kernel's, and the likelihood's with ``learn_likelihood``).
        lr: Adam's step size γ; steps: K.
        num_data: N (the evidence is reported per example).
        target_variance: the targets' mean variance (the noise's sane range is relative to it).
        distributed: make the hyperparameters exactly equal on every rank after each round.
    """

    def __init__(self, kernel: NTKKernel, likelihood: Likelihood, hypers: list[Tensor], lr: float, steps: int,
                 num_data: int, target_variance: float, distributed: bool = False) -> None:
        self.kernel, self.likelihood, self.hypers = kernel, likelihood, hypers
        self.lr, self.steps, self.n = lr, steps, num_data
        self.target_variance, self.distributed = target_variance, distributed
        self.optimizer = torch.optim.Adam(hypers, lr=lr)

    def _evidence(self, curvature) -> Tensor:
        return curvature.log_marginal_likelihood(self.kernel.prior_precision, self.likelihood)

    def run(self, curvature) -> tuple[float, list[Tensor], str | None]:
        """The K steps on ``curvature``'s evidence.

        Returns:
            ``(value, at, problem)``: the round's evidence / N (``nan`` if it cannot be factorized), the
            hyperparameters it was evaluated at (copies), and what stopped the round early (``None``: nothing;
            the hyperparameters were then reset to their last sane values).
        """
        sane = _clone(self.hypers)
        problem, value, at = None, None, sane
        for _ in range(self.steps):
            self.optimizer.zero_grad()
            try:
                objective = -self._evidence(curvature)
            except NotPSDError as error:
                problem = f"the evidence could not be factorized ({error})"
                break
            if not torch.isfinite(objective):
                problem = "the evidence became non-finite"
                break
            objective.backward()
            # the round's evidence is the last one evaluated, at the hyperparameters before this step: an
            # exact (θ*, hyperparameters, evidence) triple without another factorization
            value, at = -objective.item() / self.n, sane
            self.optimizer.step()
            out = out_of_range(self.kernel, self.likelihood, self.target_variance)
            if out:
                problem = "; ".join(out)
                break
            sane = _clone(self.hypers)
        if problem is not None:
            self._set(sane)
            self.optimizer = torch.optim.Adam(self.hypers, lr=self.lr)
        broadcast_(self.hypers, enabled=self.distributed)  # the ranks computed the same steps; make it exact
        if value is None or problem is not None:
            try:
                with torch.no_grad():
                    value = self._evidence(curvature).item() / self.n
            except NotPSDError:
                value = float("nan")
            at = _clone(self.hypers)
        return value, at, problem

    def _set(self, values: list[Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.hypers, values):
                p.copy_(v)

    def record(self, epoch: int, value: float, at: list[Tensor], train_loss: float) -> dict:
        """The history record of a round: the hyperparameters its evidence was evaluated at (``at``)."""
        current = _clone(self.hypers)
        self._set(at)
        with torch.no_grad():
            record = {"epoch": epoch, "log_evidence": value,
                      "prior_precision": self.kernel.prior_precision.detach().tolist(), "train_loss": train_loss,
                      **hyperparameter_values(self.likelihood)}
        self._set(current)
        return record

    def release_grads(self) -> None:
        """Drop the hyperparameters' gradients (the likelihood's ``.grad`` are the user's again afterwards)."""
        for p in self.hypers:
            p.grad = None
