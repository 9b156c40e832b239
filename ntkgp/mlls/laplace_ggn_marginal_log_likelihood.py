"""The Laplace-GGN log marginal likelihood as a GPyTorch marginal log likelihood."""

from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.likelihoods import Likelihood
from gpytorch.mlls import MarginalLogLikelihood
from gpytorch.module import Module

from ..laplace.function_space import EvidenceOptions, TrainingEvidence, is_kernel_covariance
from ..laplace.function_space.routes import check_options
from ..laplace.weight_space.posterior.prior_tuning import optimize_parameter_precision
from ..likelihoods import num_outputs, validate_targets
from ..models import NTKGP
from ..options import CurvatureKind, EvidenceMethod, OptionAttribute, Space, choice


class LaplaceGGNMarginalLogLikelihood(MarginalLogLikelihood):
    r"""The Laplace-GGN log marginal likelihood of an :class:`~ntkgp.NTKGP`, divided by N, as GPyTorch's MLLs are.

    .. math::
        \frac1N \Big[\sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*
        - \tfrac12 \log\lvert I + \Lambda^{1/2} K_{XX} \Lambda^{1/2}\rvert + \sum \log p(\text{hyper})\Big]

    (:func:`ntkgp.laplace.laplace_log_marginal_likelihood`), with any priors registered on the
    hyperparameters added, as in ``ExactMarginalLogLikelihood``. Used as GPyTorch's MLLs are::

        mll = ntkgp.LaplaceGGNMarginalLogLikelihood(model.likelihood, model)
        model.train()
        optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.1)
        for _ in range(100):
            optimizer.zero_grad()
            loss = -mll(model(train_x), train_y)
            loss.backward()
            optimizer.step()

    **What comes from the arguments, and why the model is needed.** ``forward(function_dist, target)``
    takes the prior covariance :math:`K_{XX}` from ``function_dist`` (the train-mode output
    ``model(train_x)``, built on the kernel's cached Grams or low-rank root, so the log-determinant is
    differentiable in :math:`\delta`), the targets from ``target`` and the likelihood terms from the
    ``likelihood`` given to the constructor. Two terms of the Laplace evidence are not functions of the
    prior over :math:`f` and come from the model: the network's outputs :math:`f(X;\theta^*)` at which the
    likelihood is expanded (the prior's mean is :math:`f - J\theta^*`, not :math:`f`), and
    :math:`\theta^{*\top} P_0 \theta^*` (the weights are not in the distribution). This is why the
    evidence equals GPyTorch's ``ExactMarginalLogLikelihood`` only at a stationary :math:`\theta^*`.

    Args:
        likelihood: the likelihood whose evidence is computed (normally ``model.likelihood``); it must have
            the model's number of outputs.
        model: an :class:`~ntkgp.NTKGP`.
        curvature: ``"ggn"`` or ``"ef"`` (empirical Fisher).
        space: ``"auto"`` (by cost), ``"function"`` or ``"weight"``.
        method: the route of the log-determinant, as for
            :func:`~ntkgp.laplace.laplace_log_marginal_likelihood`: ``"auto"`` (by size: matrix-free above
            ``options.dense_memory_limit``, else ``"eigen"`` where one δ allows it, else ``"cholesky"``),
            ``"cholesky"``, ``"eigen"`` or ``"matrix_free"`` (docs/scaling.md).
        options: :class:`~ntkgp.laplace.EvidenceOptions` (memory limit of ``"auto"``; probes, CG tolerance,
            preconditioner and seed of the matrix-free route).

    ``curvature``, ``space``, ``method`` and ``options`` may be assigned after construction (strings or enum
    members, validated as by the constructor): what the MLL keeps is keyed by them, so the next call equals that
    of an MLL built with the new value.

    **What a step costs.** On the eigen route (one δ, ``method="auto"`` or ``"eigen"``) the MLL keeps the route's
    fixed data (the eigenvalues, the data-fit statistics and :math:`\lVert\theta^*\rVert^2`) by the values of
    the training inputs, the targets and the network's weights and buffers (the network's outputs, a function of
    them, are read only to compute it), with the curvature, space and dtype: a hyperparameter step is one cache
    lookup and an :math:`O(\min(Nk, P))` evaluation, and any change of the data or the network is seen at the next
    call, as everywhere in ntkgp.

    Raises:
        TypeError: when ``model`` is not an NTKGP, ``likelihood`` not a GPyTorch likelihood or ``options`` not
            an ``EvidenceOptions``.
        ValueError: for an unknown option or a likelihood with another number of outputs.
    """

    curvature = OptionAttribute(choice(CurvatureKind), on_change="_option_changed")
    space = OptionAttribute(choice(Space), on_change="_option_changed")
    method = OptionAttribute(choice(EvidenceMethod), on_change="_option_changed")
    options = OptionAttribute(check_options, on_change="_option_changed")

    def __init__(
        self,
        likelihood: Likelihood,
        model: NTKGP,
        curvature: str = "ggn",
        space: str = "auto",
        method: str = "auto",
        options: EvidenceOptions | None = None,
    ) -> None:
        if not isinstance(model, NTKGP):
            raise TypeError(f"model must be an ntkgp.NTKGP, got {type(model).__name__}")
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
        if num_outputs(likelihood) != model.num_outputs:
            raise ValueError(
                f"likelihood {type(likelihood).__name__} expects {num_outputs(likelihood)} outputs but the model's "
                f"network has {model.num_outputs}"
            )
        options = check_options(options)  # every argument is checked before the MLL takes the model
        for enum, value, name in ((CurvatureKind, curvature, "curvature"), (Space, space, "space"),
                                  (EvidenceMethod, method, "method")):
            choice(enum)(value, name)
        super().__init__(likelihood, model)
        self._evidence = TrainingEvidence()  # keeps the eigen route's data by the model's training data and network
        self.curvature = curvature
        self.space = space
        self.method = method
        self.options = options

    def _option_changed(self, name: str) -> None:
        """Nothing to recompute: each call reads the options (the eigen route's kept data is keyed by the curvature
        and space, the model's caches do not depend on them)."""

    def forward(self, function_dist: MultivariateNormal, target: torch.Tensor, *params, **kwargs) -> torch.Tensor:
        """The evidence per data point for the prior ``function_dist = model(train_x)`` and ``target``.

        Args:
            function_dist: the model's train-mode output at its training inputs.
            target: the training targets (any form the likelihood accepts).

        Raises:
            RuntimeError: when the model is in eval mode (``function_dist`` would be the posterior).
            ValueError: when ``function_dist`` is not over the ``N·C`` training outputs, or for bad targets.
        """
        model = self.model
        if not model.training:
            raise RuntimeError(
                "LaplaceGGNMarginalLogLikelihood needs the prior at the training inputs: call model.train() and "
                "pass model(train_x)"
            )
        if not isinstance(function_dist, MultivariateNormal):
            raise TypeError(f"function_dist must be a gpytorch MultivariateNormal, got {type(function_dist).__name__}")
        kernel, likelihood, x = model.covar_module, self.likelihood, model.train_x
        n, c = model.num_data, model.num_outputs
        covariance = function_dist.lazy_covariance_matrix
        if tuple(covariance.shape) != (n * c, n * c):
            raise ValueError(
                f"function_dist must be model(train_x) over the {n}×{c} training outputs, "
                f"got a covariance of shape {tuple(covariance.shape)}"
            )
        own = is_kernel_covariance(covariance, kernel, x)
        if isinstance(covariance, LazyEvaluatedKernelTensor) and covariance.kernel is kernel and not own:
            raise ValueError(
                "function_dist must be model(train_x): its covariance is the model's kernel at other inputs (the "
                "evidence's site factors are at the training inputs)"
            )
        if target is None:
            raise ValueError("target must be the training targets")
        y = validate_targets(likelihood, target, c, num_data=n, name="target").to(device=x.device)
        given = None if own else covariance  # the kernel's own K_XX: the evidence need not compare it again
        evidence = self._evidence(kernel, likelihood, x, lambda: model.train_outputs, y, (n, c, model.dtype),
                                  self.curvature, self.space, given, self.method, self.options)
        # The registered priors, as named_priors() yields them but each module once (the likelihood is reached twice,
        # as self.likelihood and model.likelihood): modules() is one walk, without named_priors' nested generators.
        for module in self.modules():
            if isinstance(module, Module):
                for prior, closure, _ in module._priors.values():
                    if prior is not None:
                        evidence = evidence + prior.log_prob(closure(module)).sum()
        return evidence / n

    def optimize_prior_precision(self, optimizer: str = "adam", steps: int = 100, lr: float = 0.1, grid=None,
                                 sweeps: int = 2, progress: bool = False) -> torch.Tensor:
        r"""Maximize this MLL (the evidence per data point, with any registered hyperparameter priors) over the
        model's :math:`\delta` alone, set it and return it; the arguments as
        :meth:`ntkgp.NTKGP.optimize_prior_precision`. The model is put in train mode for the evaluations and
        left in the mode it was in."""
        model = self.model
        mode = model.training
        model.train()
        try:
            return optimize_parameter_precision(lambda: self(model(model.train_x), model.train_y), model.covar_module,
                                                optimizer, steps, lr, grid, sweeps, progress)
        finally:
            model.train(mode)
