r"""BoTorch adapter for :class:`~ntkgp.NTKGP`, :class:`~ntkgp.SFR` and :class:`~ntkgp.fsvi.FSVI`
(``pip install 'ntkgp[botorch]'``).

BoTorch is imported lazily, only when one of these functions is called, so that ``import ntkgp`` works
without it. The models implement BoTorch's ``Model`` interface duck-typed, through
:class:`BoTorchInterface`:

* ``model.posterior(X, output_indices=None, observation_noise=False, posterior_transform=None)`` returns a
  ``botorch.posteriors.GPyTorchPosterior`` over :math:`f(X)` (the GLM predictive, docs/math.md, "GLM
  predictive"); ``X`` of shape ``(b, q, d)`` gives ``b`` joint distributions over ``q`` points, mean
  ``(b, q, m)``;
* ``model.num_outputs``, ``model.batch_shape`` (``torch.Size([])``);
* ``model.condition_on_observations(X, Y)``: ``condition_on`` (NTKGP, FSVI) / ``update`` on a copy sharing the
  network (SFR), a new model;
* ``model.fantasize(X, sampler)``: a :class:`FantasyModel` with the sampler's (and ``X``'s) batch shape in front.

Every BoTorch acquisition function tried (``LogExpectedImprovement``, ``UpperConfidenceBound``,
``qLogNoisyExpectedImprovement``) and ``optimize_acqf`` accept the models themselves. Code that checks
``isinstance(model, botorch.models.model.Model)`` gets such an object from :func:`as_botorch`.

The plain GPyTorch distribution (no BoTorch objects) is ``model(x)`` in eval mode, or
``NTKGP.predictive_distribution(x)``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

__all__ = ["BoTorchInterface", "FantasyModel", "as_botorch", "botorch_posterior", "select_outputs", "to_posterior"]

INSTALL_HINT = "BoTorch is needed for this: pip install 'ntkgp[botorch]'"


def _gpytorch_posterior_class():
    try:
        from botorch.posteriors.gpytorch import GPyTorchPosterior
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return GPyTorchPosterior


def gradient_settings():
    """The GPyTorch settings under which a model's ``posterior`` computes, as BoTorch's ``GPyTorchModel.posterior``
    sets them: while ``botorch.settings.propagate_grads`` is on (look-ahead acquisition functions evaluating the
    fantasy models they differentiate through), ``gpytorch.settings.detach_test_caches`` is off, so that the
    caches of a conditioned model keep their graph to the inputs it was conditioned on.

    Raises:
        ImportError: without BoTorch, with the install hint.
    """
    import gpytorch

    try:
        from botorch import settings
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return gpytorch.settings.detach_test_caches(False) if settings.propagate_grads.on() else contextlib.nullcontext()


def to_posterior(dist: MultivariateNormal, posterior_transform=None):
    """Wrap a GPyTorch distribution in BoTorch's ``GPyTorchPosterior`` and apply ``posterior_transform``.

    The transform is applied as BoTorch's ``GPyTorchModel.posterior`` applies it: ``posterior_transform(posterior)``.

    Raises:
        ImportError: without BoTorch, with the install hint.
    """
    posterior = _gpytorch_posterior_class()(dist)
    return posterior if posterior_transform is None else posterior_transform(posterior)


def select_outputs(dist: MultivariateNormal, indices: list[int], num_outputs: int) -> MultivariateNormal:
    """The joint distribution of the outputs ``indices`` (interleaved order kept), lazily indexed.

    Raises:
        ValueError: for indices outside ``0..num_outputs-1`` or an empty list.
    """
    idx = torch.as_tensor(indices, dtype=torch.long, device=dist.mean.device)
    if idx.dim() != 1 or idx.numel() == 0 or bool(((idx < 0) | (idx >= num_outputs)).any()):
        raise ValueError(f"output_indices must be distinct outputs in 0..{num_outputs - 1}, got {indices!r}")
    if num_outputs == 1 or list(indices) == list(range(num_outputs)):
        return dist
    mean = dist.mean[..., idx]
    n = mean.shape[-2]
    rows = (torch.arange(n, device=idx.device)[:, None] * num_outputs + idx).reshape(-1)
    covariance = dist.lazy_covariance_matrix[..., rows, :][..., :, rows]
    if idx.numel() == 1:
        return MultivariateNormal(mean[..., 0], covariance)
    return MultitaskMultivariateNormal(mean, covariance, interleaved=True)


def botorch_posterior(model, X: Tensor, output_indices=None, observation_noise=False, posterior_transform=None, **kwargs):
    """BoTorch's ``Model.posterior`` for a model whose eval-mode call ``model(X, **kwargs)`` is the predictive over f.

    Args:
        model: an :class:`~ntkgp.SFR` (or any ntkgp model with ``num_outputs`` and ``likelihood``).
        X: inputs ``(*batch, q, d)``.
        output_indices: outputs to keep (default all).
        observation_noise: ``True`` adds the Gaussian likelihood's noise; a tensor of shape ``(*batch, q, m)``
            (or ``(*batch, q)`` for one output) adds those variances.
        posterior_transform: applied to the ``GPyTorchPosterior`` (e.g. ``ScalarizedPosteriorTransform``).
        **kwargs: passed to the model call (``chunk_size``).

    Raises:
        ImportError: without BoTorch.
        TypeError, ValueError: for invalid ``observation_noise`` or ``output_indices``.
    """
    from .likelihoods import is_gaussian

    _gpytorch_posterior_class()  # fail early, before any computation
    c = model.num_outputs
    indices = list(range(c)) if output_indices is None else list(output_indices)
    if isinstance(observation_noise, bool) or observation_noise is None:
        noise = None
    elif torch.is_tensor(observation_noise):
        noise = observation_noise
    else:
        raise TypeError(f"observation_noise must be a bool or a tensor, got {type(observation_noise).__name__}")
    if observation_noise is True and not is_gaussian(model.likelihood):
        raise ValueError(
            f"observation_noise=True needs a Gaussian likelihood; {type(model.likelihood).__name__} has no noise to add"
        )
    with gradient_settings():
        dist = model(X, **kwargs)
    if observation_noise is True:
        dist = model.likelihood(dist)
    dist = select_outputs(dist, indices, c)
    if noise is not None:
        expected = (*dist.mean.shape, 1) if len(indices) == 1 else tuple(dist.mean.shape)
        if tuple(noise.shape) not in (expected, tuple(dist.mean.shape)):
            raise ValueError(f"observation_noise must have shape {expected}, got {tuple(noise.shape)}")
        if (noise < 0).any() or not torch.isfinite(noise).all():
            raise ValueError("observation_noise must be finite and non-negative")
        diag = DiagLinearOperator(noise.to(dist.mean).reshape(*dist.mean.shape[: -2 if len(indices) > 1 else -1], -1))
        covariance = dist.lazy_covariance_matrix + diag
        dist = type(dist)(dist.mean, covariance, **({"interleaved": True} if len(indices) > 1 else {}))
    return to_posterior(dist, posterior_transform)


def _targets(Y: Tensor, num_outputs: int) -> Tensor:
    """BoTorch's ``(n, m)`` observations as ntkgp targets: ``(n,)`` for one output."""
    return Y.squeeze(-1) if num_outputs == 1 and Y.dim() >= 1 and Y.shape[-1] == 1 else Y


class BoTorchInterface:
    """Mixin: BoTorch's ``Model`` methods beyond ``posterior`` (duck-typed; BoTorch is never imported here).

    The host class defines ``num_outputs``, ``likelihood``, ``posterior`` and ``condition_on`` or ``update``.
    """

    _supports_cache_root = False  # BoTorch's cached-Cholesky shortcut assumes its own GPyTorchModel

    @property
    def batch_shape(self) -> torch.Size:
        """BoTorch's ``Model.batch_shape``: one model, ``torch.Size([])``."""
        return torch.Size([])

    def _condition(self, X: Tensor, Y: Tensor):
        """``condition_on`` (a new model), or ``update`` on a copy that shares the network (this model unchanged)."""
        if hasattr(self, "condition_on"):
            return self.condition_on(X, Y)
        if torch.is_grad_enabled() and torch.is_tensor(X) and X.requires_grad:
            raise NotImplementedError(
                f"{type(self).__name__}.update is not differentiable in the new inputs (its statistics are summed "
                "without a graph), so conditioning on X that requires grad would give zero gradients w.r.t. X, "
                "silently wrong for look-ahead acquisition functions such as qKnowledgeGradient. Condition on "
                "X.detach(), or use NTKGP or FSVI, whose conditioning is differentiable in X."
            )
        net = self.covar_module.engine.net
        memo = {id(net): net}
        memo.update({id(t): t for t in itertools.chain(net.parameters(), net.buffers())})
        return copy.deepcopy(self, memo).update(X, Y)

    def condition_on_observations(self, X: Tensor, Y: Tensor, **kwargs: Any):
        """BoTorch's name for ``condition_on`` (NTKGP) / ``update`` (SFR): a new model, this one unchanged.

        Args:
            X: new inputs ``(n, d)``; with batch dimensions ``(*b, n, d)`` a :class:`FantasyModel` is returned.
            Y: their observations ``(n, m)`` (or ``(*b, n, m)``, with ``Y``'s extra leading dimensions in front).

        Raises:
            NotImplementedError: for keyword arguments such as ``noise`` (per-point noise is not supported).
        """
        if kwargs:
            raise NotImplementedError(f"condition_on_observations does not support {sorted(kwargs)}")
        if isinstance(X, dict | tuple) and torch.is_tensor(Y) and Y.dim() <= 2:  # structured inputs, no fantasy batch
            return self._condition(X, _targets(Y, self.num_outputs))  # (docs/networks.md, "Dict and tuple inputs")
        if not torch.is_tensor(X) or not torch.is_tensor(Y):
            raise TypeError("X and Y must be tensors")
        if X.dim() == 2 and Y.dim() <= 2:
            return self._condition(X, _targets(Y, self.num_outputs))
        return FantasyModel(self, X, Y)

    def fantasize(self, X: Tensor, sampler, observation_noise: Tensor | None = None, **kwargs: Any):
        """BoTorch's ``Model.fantasize``: condition on observations sampled at ``X`` (noise included).

        Args:
            X: ``(*b, q, d)`` inputs.
            sampler: a BoTorch ``MCSampler``; its ``sample_shape`` goes in front of the fantasy batch.
            observation_noise: ``None`` (the likelihood's noise) or a noise tensor for sampling.

        Returns:
            A :class:`FantasyModel` of batch shape ``sampler.sample_shape + X.shape[:-2]``.

        Raises:
            NotImplementedError: for classification likelihoods (fantasy observations are real-valued).
        """
        from .likelihoods import is_gaussian

        if not is_gaussian(self.likelihood):
            raise NotImplementedError("fantasize needs a Gaussian likelihood (fantasy observations are real-valued)")
        kwargs.pop("propagate_grads", None)
        if kwargs:
            raise NotImplementedError(f"fantasize does not support {sorted(kwargs)}")
        noise = True if observation_noise is None else observation_noise
        # as BoTorch's Model.fantasize: the fantasies keep their graph to X (look-ahead acquisition functions such
        # as qKnowledgeGradient differentiate through them)
        posterior = self.posterior(X, observation_noise=noise)
        Y = sampler(posterior)  # (S, *b, q, m)
        return FantasyModel(self, X, Y)


class FantasyModel(torch.nn.Module):
    r"""A batch of models, each conditioned on one fantasy: ``Y`` of shape ``(*s, *b, q, m)`` at ``X`` ``(*b, q, d)``.

    ``batch_shape = (*s, *b)``; ``posterior(X_test)`` with ``X_test`` ``(*e, n, d)`` (broadcast against the batch
    shape) returns a ``GPyTorchPosterior`` of mean ``(*broadcast(e, batch_shape), n, m)``. The members are built
    by ``condition_on`` / ``update`` one by one (dense stacked covariances: meant for the small batches of
    look-ahead acquisition functions).
    """

    def __init__(self, model, X: Tensor, Y: Tensor):
        super().__init__()
        if X.dim() < 2 or Y.dim() < X.dim() or Y.shape[-2] != X.shape[-2]:
            raise ValueError(f"X (*b, q, d) and Y (*s, *b, q, m) do not match: {tuple(X.shape)}, {tuple(Y.shape)}")
        self.base = model
        self.num_outputs = model.num_outputs
        self.likelihood = model.likelihood
        batch = Y.shape[:-2]
        self._batch_shape = torch.Size(batch)
        Xb = X.expand(*batch, *X.shape[-2:])
        self.members = [
            model._condition(Xb[i], _targets(Y[i], model.num_outputs)) for i in itertools.product(*map(range, batch))
        ]

    @property
    def batch_shape(self) -> torch.Size:
        return self._batch_shape

    def posterior(self, X: Tensor, output_indices=None, observation_noise=False, posterior_transform=None, **kwargs):
        """Each member's posterior at its slice of ``X`` (broadcast), stacked along the fantasy batch dimensions."""
        batch = self._batch_shape
        shape = torch.broadcast_shapes(X.shape[:-2], batch)
        Xe = X.expand(*shape, *X.shape[-2:])
        extra = len(shape) - len(batch)
        means, covs = [], []
        for k, i in enumerate(itertools.product(*map(range, batch))):
            xi = Xe[(slice(None),) * extra + i]
            dist = self.members[k].posterior(xi, output_indices, observation_noise, **kwargs).distribution
            means.append(dist.mean)
            covs.append(dist.covariance_matrix)
        mean = torch.stack(means, dim=extra).reshape(*shape, *means[0].shape[extra:])
        cov = torch.stack(covs, dim=extra).reshape(*shape, *covs[0].shape[extra:])
        if mean.dim() == len(shape) + 2:
            dist = MultitaskMultivariateNormal(mean, cov, interleaved=True)
        else:
            dist = MultivariateNormal(mean, cov)
        return to_posterior(dist, posterior_transform)


def as_botorch(model):
    """A ``botorch.models.model.Model`` subclass instance wrapping ``model`` (for code that checks ``isinstance``).

    Its ``posterior``, ``condition_on_observations`` and ``fantasize`` delegate to ``model``.

    Raises:
        ImportError: without BoTorch.
    """
    try:
        from botorch.models.model import Model
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error

    class BoTorchModel(Model):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        @property
        def num_outputs(self) -> int:
            return self.model.num_outputs

        @property
        def batch_shape(self) -> torch.Size:
            return self.model.batch_shape

        def posterior(self, X, output_indices=None, observation_noise=False, posterior_transform=None, **kwargs):
            return self.model.posterior(X, output_indices, observation_noise, posterior_transform, **kwargs)

        def condition_on_observations(self, X, Y, **kwargs):
            return BoTorchModel(self.model.condition_on_observations(X, Y, **kwargs))

        def fantasize(self, X, sampler, observation_noise=None, **kwargs):
            return BoTorchModel(self.model.fantasize(X, sampler, observation_noise, **kwargs))

    return BoTorchModel(model)
