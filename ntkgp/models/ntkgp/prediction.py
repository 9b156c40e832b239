"""The predictive of :class:`~ntkgp.NTKGP`: ``predictive_distribution`` (GPyTorch's) and ``posterior`` (BoTorch's),
computed in chunks of test points."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DiagLinearOperator

from ...botorch import gradient_settings, to_posterior
from ...laplace.function_space import GLMPredictiveCovariance, PredictiveContext
from ...likelihoods import is_gaussian, noise_variance
from ...linalg import all_finite
from ...memory import PREDICTION_BYTES, chunk_rows
from ...options import PredictiveMean
from ...ntk.inputs import to as to_network
from ...ntk.packed_inputs import pack_inputs
from ...ntk.private_copy import model_lock
from ...progress import Progress
from .arguments import check_floating, positive_int
from .newton_step import parameter_dict, shifted_outputs

__all__ = ["PredictionMixin"]


class PredictionMixin:
    """The predictive methods of :class:`~ntkgp.NTKGP` (the host defines the data, the kernel, the site posterior)."""

    # ------------------------------------------------------------------ inputs
    def _flat_inputs(self, x: torch.Tensor, argument: str) -> torch.Tensor:
        """``x`` as ``(*batch, n, D)`` in the model's dtype (trailing ``input_shape`` dimensions flattened; structured
        inputs packed, :mod:`ntkgp.ntk.packed_inputs`)."""
        x = pack_inputs(self.covar_module.engine.net, x, argument)
        check_floating(x, argument)
        d = self.train_x.shape[-1]
        shape = self.input_shape
        if shape is not None and len(shape) > 1 and x.dim() > len(shape) and tuple(x.shape[-len(shape) :]) == shape:
            x = x.flatten(-len(shape))
        if x.dim() < 2 or x.shape[-1] != d:
            expected = f"(*batch, n, {d})"
            if shape is not None and len(shape) > 1:
                expected += f" or (*batch, n, {', '.join(map(str, shape))})"
            raise ValueError(f"{argument} must have shape {expected}, got {tuple(x.shape)}")
        if not all_finite(x):
            raise ValueError(f"{argument} contains NaN or Inf values")
        return to_network(x, self.dtype, self.train_x.device)  # integer token ids stay integer

    def _output_indices(self, output_indices: Sequence[int] | None) -> tuple[int, ...] | None:
        if output_indices is None:
            return None
        if isinstance(output_indices, int) or not isinstance(output_indices, Sequence) or not output_indices:
            raise ValueError(f"output_indices must be a non-empty list of output indices, got {output_indices!r}")
        for i in output_indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_outputs:
                raise ValueError(f"output_indices must hold integers in [0, {self.num_outputs}), got {list(output_indices)}")
        indices = tuple(output_indices)
        return None if indices == tuple(range(self.num_outputs)) else indices

    def prediction_chunk(self, chunk_size: int | None = None) -> int:
        """Test points per chunk: ``chunk_size``, else :attr:`prediction_chunk_size`, else the largest chunk
        whose working set ``(G + 3)·chunk·C·N·C`` fits :data:`ntkgp.memory.PREDICTION_BYTES` (at least 1)."""
        if chunk_size is None:
            chunk_size = self.prediction_chunk_size
        if chunk_size is not None:
            return positive_int(chunk_size, "chunk_size")
        n, c = self.num_data, self.num_outputs
        groups = self.covar_module.engine.num_groups
        return chunk_rows(PREDICTION_BYTES, (groups + 3) * c * n * c, self.dtype)

    # ------------------------------------------------------------------ the predictive
    def posterior(
        self,
        X: torch.Tensor,
        output_indices: Sequence[int] | None = None,
        observation_noise: bool | torch.Tensor = False,
        posterior_transform=None,
        chunk_size: int | None = None,
        **kwargs,
    ):
        r"""BoTorch's ``Model.posterior``: the GLM predictive over :math:`f` at ``X`` as a ``GPyTorchPosterior``.

        :meth:`predictive_distribution` wrapped by :func:`ntkgp.botorch.to_posterior` (BoTorch is imported
        only here; ``pip install 'ntkgp[botorch]'``), then ``posterior_transform`` applied as BoTorch does.
        ``X`` of shape ``(b, q, d)`` gives a posterior of mean ``(b, q, m)``.

        Raises:
            ImportError: without BoTorch.
            TypeError, ValueError: as :meth:`predictive_distribution`.
        """
        with gradient_settings():
            dist = self.predictive_distribution(X, output_indices, observation_noise, chunk_size=chunk_size, **kwargs)
        return to_posterior(dist, posterior_transform)

    def predictive_distribution(
        self,
        X: torch.Tensor,
        output_indices: Sequence[int] | None = None,
        observation_noise: bool | torch.Tensor = False,
        chunk_size: int | None = None,
        **kwargs,
    ) -> MultivariateNormal:
        r"""The GLM predictive over :math:`f` at ``X`` as a GPyTorch distribution (what eval-mode ``model(X)`` returns).

        The mean is the one :attr:`predictive_mean` names (``"gp"``: the linearized posterior mean
        :math:`f(x_*;\theta^*) + J_* s`, one forward-mode pass per chunk; ``"nn"``: the network's output). Test points are processed in chunks of
        ``chunk_size``: the mean is computed at once, the covariance is a lazy
        :class:`~ntkgp.laplace.GLMPredictiveCovariance` that evaluates what is asked for (``.variance``,
        per-point blocks, products) chunk by chunk. Both passes over the test points follow :attr:`progress`
        (``"NTKGP prediction"`` for the mean, ``"NTKGP prediction (variances)"``, ``(covariance)``, ``(products)``,
        ``(entries)`` for the covariance's evaluations, with the kernel's Gram passes silent within them). Memory is bounded by about
        ``(G + 3)·chunk·C·N·C`` numbers whatever the number of test points (docs/ntkgp.md).

        When ``X`` requires grad the mean and (co)variance are differentiable w.r.t. ``X`` (including the
        :math:`f(x)` term of the mean).

        Args:
            X: test inputs ``(*batch, n, D)`` (or ``(*batch, n, *input_shape)``); ``(b, q, d)`` is a batch of
                ``b`` joint distributions over ``q`` points each.
            output_indices: the outputs to return (default all ``C``).
            observation_noise: ``True`` adds the Gaussian likelihood's noise variances; a tensor broadcastable
                to the mean's shape ``(*batch, n, C')`` adds those variances. Gaussian likelihoods only.
            chunk_size: test points per chunk (default :meth:`prediction_chunk`).

        Returns:
            A ``MultivariateNormal`` with mean ``(*batch, n)`` when one output is returned, else an interleaved
            ``MultitaskMultivariateNormal`` with mean ``(*batch, n, C')``.

        Raises:
            TypeError: for unknown keyword arguments or a non-floating ``X``.
            ValueError: for shapes, non-finite inputs, bad ``output_indices`` or ``observation_noise``.
        """
        if kwargs:
            raise TypeError(f"predictive_distribution got unexpected keyword arguments {sorted(kwargs)}")
        x = self._flat_inputs(X, "X")
        outputs = self._output_indices(output_indices)
        chunk = self.prediction_chunk(chunk_size)
        noise = self._observation_noise(observation_noise)
        batch, n, d = x.shape[:-2], x.shape[-2], x.shape[-1]
        post, step = self._fitted()
        context = PredictiveContext(self.covar_module, post, self.train_x, self.num_outputs, outputs, chunk,
                                    self.progress)
        points = x.reshape(-1, d)
        engine = self.covar_module.engine
        network_only = self.predictive_mean is PredictiveMean.NN
        shift = None if network_only else parameter_dict(engine, step)
        means = []
        with Progress(points.shape[0], "NTKGP prediction", self.progress, unit="point") as bar:
            for s, e in context.chunks(points.shape[0]):
                xs = points[s:e]
                if network_only:
                    means.append(self._network_mean.values(xs).to(post.dtype))
                else:  # f(x*) + J* s: the network output plus the correction (never m(x*) + K*X(...), which cancels)
                    means.append(shifted_outputs(engine, xs, shift).to(post.dtype))
                bar.update(e - s)
        c = self.num_outputs
        mean = torch.cat(means) if means else torch.zeros(0, c, dtype=post.dtype, device=x.device)
        if outputs is not None:
            mean = mean[:, list(outputs)]
        mean = mean.reshape(*batch, n, mean.shape[-1])
        covar = GLMPredictiveCovariance(to_network(x, post.dtype, x.device), context)
        if noise is not None:
            covar = covar + DiagLinearOperator(self._noise_diagonal(noise, outputs, mean.shape).to(post.dtype))
        return self._mvn(mean, covar)

    def _observation_noise(self, observation_noise: bool | torch.Tensor) -> bool | torch.Tensor | None:
        if isinstance(observation_noise, bool):
            if not observation_noise:
                return None
        elif not isinstance(observation_noise, torch.Tensor):
            raise TypeError(f"observation_noise must be a bool or a tensor, got {type(observation_noise).__name__}")
        elif not (torch.isfinite(observation_noise).all() and (observation_noise >= 0).all()):
            raise ValueError("observation_noise must hold finite non-negative variances")
        if not is_gaussian(self.likelihood):
            raise ValueError(
                "observation_noise is defined for Gaussian likelihoods only; for class probabilities use "
                "model.likelihood(model(x))"
            )
        return observation_noise

    def _noise_diagonal(self, noise: bool | torch.Tensor, outputs: tuple[int, ...] | None, shape: torch.Size) -> torch.Tensor:
        """The added variances in the covariance's interleaved order, ``(*batch, n·C')``."""
        if isinstance(noise, bool):
            variances = noise_variance(self.likelihood).detach()
            if outputs is not None:
                variances = variances[list(outputs)]
            values = variances.expand(shape)
        else:
            try:
                values = noise.expand(shape)
            except RuntimeError:
                raise ValueError(f"observation_noise of shape {tuple(noise.shape)} does not broadcast to {tuple(shape)}") from None
        return values.reshape(*shape[:-2], -1)


    # ------------------------------------------------------------------ GPyTorch calls
    def _call_eval(self, x: torch.Tensor, **kwargs) -> MultivariateNormal:
        with model_lock(self):  # one prediction (and cache fill) at a time per model: docs/guarantees.md, "Threads"
            return self.predictive_distribution(x, **kwargs)
