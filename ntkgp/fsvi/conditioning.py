r"""Conditioning :class:`~ntkgp.fsvi.FSVI` on new observations: the exact posterior of its linearized GP under a
Gaussian likelihood's noise, Matheron's rule in weight space for its draws, and the observations in the model's
state (``state_dict``, pickling)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import RootLinearOperator
from torch import Tensor

from ..caching import ValueCache
from ..likelihoods import is_gaussian, noise_variance, validate_targets
from ..linalg import cholesky
from ..ntk.checks import OutputShapeError
from ..persistence import CheckedLoad
from .linearized import LinearizedNetwork


class Conditioning(CheckedLoad):
    """The conditioning of :class:`~ntkgp.fsvi.FSVI` (a mixin of the model: it reads its ``likelihood``,
    ``linearized``, ``variational_distribution``, ``mean_module`` and ``covar_module``).

    The observations are part of the model's state: ``state_dict()`` holds them (detached) and the input shape
    (:attr:`STATE_KEYS`), so ``load_state_dict`` into a freshly built :class:`~ntkgp.fsvi.FSVI` gives a model
    conditioned on them that predicts as the saved one; the state of a model that was not conditioned makes a
    conditioned model forget its observations (the state describes the whole model). A state dict that does not
    fit is refused before anything is loaded (:class:`~ntkgp.persistence.CheckedLoad`)."""

    _observed: tuple[Tensor, Tensor] | None
    _conditioning_cache: ValueCache

    def _init_conditioning(self) -> None:
        self._observed = None  # (x (M, D) flat, y (M, C)) after condition_on
        self._conditioning_cache = ValueCache(size=1)

    @property
    def observations(self) -> tuple[Tensor, Tensor] | None:
        """The observations this model is conditioned on: ``(x, y)`` of shapes ``(M, D)`` (inputs flattened) and
        ``(M, C)``, detached copies, or ``None`` for a model that was not conditioned."""
        if self._observed is None:
            return None
        return tuple(t.detach().clone() for t in self._observed)

    def _check_observations(
        self, x_new: Tensor, y_new: Tensor, stored: bool = False
    ) -> tuple[Tensor, Tensor, tuple[int, ...] | None]:
        """``x_new`` flat ``(M, D)`` and ``y_new`` ``(M, C)`` in the model's dtype (copies), and the input shape
        that images fix; everything is checked here, before anything is built. ``stored``: observations read
        from a state dict, which replace this model's (if any)."""
        if not is_gaussian(self.likelihood):
            raise NotImplementedError(
                f"condition_on needs a Gaussian likelihood (GaussianLikelihood or MultitaskGaussianLikelihood); "
                f"under {type(self.likelihood).__name__} the observations are not Gaussian in f, so the linearized "
                "GP has no closed-form posterior given them. Train on the union of the data instead."
            )
        x_new = self.packed(x_new, "x_new")  # a dict/tuple of tensors: packed rows (ntkgp.ntk.packed_inputs)
        if not isinstance(x_new, Tensor):
            raise TypeError(f"x_new must be a torch.Tensor, got {type(x_new).__name__}")
        if x_new.is_complex():  # floating point, or integer token ids (passed to the network as they are)
            raise TypeError(f"x_new must be a real tensor, got dtype {x_new.dtype}")
        if x_new.dim() < 2 or x_new.shape[0] == 0:
            raise ValueError(
                "x_new must have shape (M, ...) with M >= 1 and a feature dimension (no batch dimensions; "
                f"condition_on_observations handles fantasy batches), got {tuple(x_new.shape)}"
            )
        if not isinstance(y_new, Tensor):
            raise TypeError(f"y_new must be a torch.Tensor, got {type(y_new).__name__}")
        if y_new.is_complex():
            raise TypeError(f"y_new must be a real tensor, got dtype {y_new.dtype}")
        reference = self._reference()
        c = self.num_outputs
        x = self.prepare(x_new, "x_new")  # finite values, the input shape, the model's dtype
        y = validate_targets(self.likelihood, y_new, c, num_data=x.shape[0], name="y_new")  # (M, C), finite
        try:  # the network takes x_new and gives C outputs
            self._fits(x.detach(), "x_new", c)
        except OutputShapeError as error:
            raise ValueError(
                f"x_new of shape {tuple(x_new.shape)} does not give one row of network outputs per input ({error}); "
                "x_new must have shape (M, ...) without batch dimensions"
            ) from error
        input_shape = tuple(x.shape[1:]) if x.dim() > 2 and self.linearized.input_shape is None else None
        x = x.flatten(1)
        if not stored and self._observed is not None and x.shape[1] != self._observed[0].shape[1]:
            raise ValueError(
                f"x_new has {x.shape[1]} features per input (flattened), the observations this model is "
                f"conditioned on {self._observed[0].shape[1]}"
            )
        return x.clone(), y.to(reference).clone(), input_shape

    def condition_on(self, x_new: Tensor, y_new: Tensor):
        r"""A new model: this one's linearized GP conditioned on ``(x_new, y_new)`` under the likelihood's noise.

        Exact GP regression with this model as the prior, :math:`\mu`, :math:`s` and the noise fixed (nothing is
        retrained). With :math:`K(x, x') = J_\mu(x) \operatorname{diag}(s^2) J_\mu(x')^\top`, :math:`m(x) =
        f(x; \mu)`, the observed inputs :math:`X` and targets :math:`Y` (``M·C`` values in GPyTorch's interleaved
        order) and :math:`\Sigma` the noise variance of each task (``noise``, or ``task_noises`` plus the global
        ``noise``), the new model's ``model(x)`` is

        .. math::
            N\big(m(x) + K(x, X) (K(X, X) + \Sigma)^{-1} (Y - m(X)),\;
                K(x, x') - K(x, X) (K(X, X) + \Sigma)^{-1} K(X, x')\big),

        from a Cholesky factor of :math:`K(X, X) + \Sigma` (jitter only if that fails, with a warning) and the
        structured cross-covariances :math:`K(x, X)` (never the Jacobian). Conditioning a conditioned model
        adds to its observations: the result equals conditioning the original once on all of them.

        The new model holds copies of :math:`\mu`, :math:`s`, the prior and the likelihood (this model is
        unchanged; changing one does not change the other) and the same network (shared, never modified). Its
        factorization is recomputed from the current values whenever :math:`\mu`, :math:`s`, the noise or the
        network's fixed weights and buffers change (e.g. after an optimizer step); it is reused between calls
        only when no gradient with respect to them is needed (under ``torch.no_grad()``, or with
        ``requires_grad_(False)``), keyed by their values. The observations keep their autograd graph:
        gradients flow to ``x_new`` (as BoTorch's look-ahead acquisition functions need). They are part of the
        new model's ``state_dict`` (detached): a fresh :class:`~ntkgp.fsvi.FSVI` that loads it is conditioned on
        them too.

        On the new model ``model(x)``, ``predict(x, method="linearized")`` and :meth:`posterior` are
        conditioned. ``predict(x, method="mc")`` and :meth:`function_samples` are too, by Matheron's rule in
        weight space (:class:`MatheronUpdate`): each draw :math:`\theta \sim q` with noise
        :math:`\epsilon \sim N(0, \Sigma)` becomes :math:`\theta' = \theta + \operatorname{diag}(s^2)
        J_\mu(X)^\top (K(X, X) + \Sigma)^{-1} (Y - f(X; \mu) - J_\mu(X)(\theta - \mu) - \epsilon)`, then goes
        through the network (exact draws from the conditioned GP for a network linear in :math:`\theta`;
        otherwise the linear-Gaussian update of :math:`q` pushed through the network).
        :meth:`function_space_kl` is still the KL of :math:`q`.

        Args:
            x_new: new inputs ``(M, D)`` or ``(M, *input_shape)``, floating point, finite.
            y_new: their targets ``(M, C)`` (``(M,)`` for one output), finite.

        Returns:
            A new :class:`~ntkgp.fsvi.FSVI`, in the same train/eval mode.

        Raises:
            NotImplementedError: for a classification likelihood.
            TypeError: for a non-tensor or non-floating ``x_new``, a non-tensor or complex ``y_new``.
            ValueError: for shapes (no batch dimensions), non-finite values, inputs that do not fit the network, a
                number of outputs that does not match, naming the argument.
        """
        x, y, input_shape = self._check_observations(x_new, y_new)
        if self._observed is not None:
            x_old, y_old = self._observed
            x, y = torch.cat([x_old.to(x), x]), torch.cat([y_old.to(y), y])
        # the network is shared, never copied: LinearizedNetwork.__deepcopy__ keeps the reference
        memo = {id(self._conditioning_cache): ValueCache(size=1)}
        if self._observed is not None:
            memo[id(self._observed)] = None  # replaced below (may hold an autograd graph: not deep-copyable)
        new = copy.deepcopy(self, memo)
        if input_shape is not None:
            new.linearized.input_shape = input_shape
        new._observed = (x, y)
        return new

    # ------------------------------------------------------------------ the observations in the state
    #: the entries of ``state_dict()`` beside those of the parameters and buffers (tensors, so that a state
    #: dict stays a mapping of tensors): the observed inputs ``(M, D)`` and targets ``(M, C)`` (empty ``(0,)``
    #: on a model that was not conditioned) and the input shape (int64, empty while unknown)
    STATE_KEYS = ("observed_x", "observed_y", "input_shape")

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        reference = self._reference().detach()
        if self._observed is None:
            x = y = reference.new_zeros(0)
        else:
            x, y = (t if keep_vars else t.detach() for t in self._observed)
        shape = self.linearized.input_shape or ()
        destination[prefix + "observed_x"], destination[prefix + "observed_y"] = x, y
        destination[prefix + "input_shape"] = torch.tensor(shape, dtype=torch.int64, device=reference.device)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """``load_state_dict``: this model is then conditioned on the stored observations (or on none) and takes
        the stored input shape. Everything is checked before anything changes (the parameters are loaded
        after this, by the submodules).

        Raises:
            ValueError: an input shape other than this model's, or observations that do not fit the model (as
                :meth:`condition_on` checks them)."""
        keys = [prefix + k for k in self.STATE_KEYS]
        present = [k in state_dict for k in keys]
        if all(present):
            self._restore(*(state_dict[k] for k in keys))
        else:
            missing_keys.extend(k for k, here in zip(keys, present) if not here)
        rest = {k: v for k, v in state_dict.items() if k not in keys}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _restore(self, x: object, y: object, shape: object) -> None:
        """Set the observations and the input shape read from a state dict, after checking them all."""
        for name, value in (("observed_x", x), ("observed_y", y), ("input_shape", shape)):
            if not isinstance(value, Tensor):
                raise ValueError(f"the state's {name} must be a tensor, got {type(value).__name__}")
        if shape.dim() != 1 or (shape.is_floating_point() and not bool((shape == shape.round()).all())):
            raise ValueError(f"the state's input_shape must be a vector of integers, got {shape!r}")
        shape = tuple(int(s) for s in shape.tolist()) or None
        current = self.linearized.input_shape
        if shape is not None and current is not None and tuple(current) != shape:
            raise ValueError(f"the state was saved with input_shape {shape}, this model has input_shape {tuple(current)}")
        observed = None
        if x.numel() or y.numel() or x.dim() != 1 or y.dim() != 1:
            if shape is not None and x.dim() == 2:
                x = x.reshape(x.shape[0], *shape)  # checked as inputs of the network's own shape
            try:
                x, y, _ = self._check_observations(x, y, stored=True)
            except (TypeError, ValueError, NotImplementedError) as error:
                raise ValueError(f"the observations in the state do not fit this model: {error}") from error
            observed = (x, y)
        if shape is not None and current is None:
            self.linearized.input_shape = shape
        self._observed = observed
        self._conditioning_cache = ValueCache(size=1)

    def __getstate__(self) -> dict:
        """For ``pickle`` and ``torch.save`` of the whole model: the observations without their autograd graph
        (a graph cannot be pickled) and an empty factorization cache."""
        state = super().__getstate__()
        if state.get("_observed") is not None:
            state["_observed"] = tuple(t.detach() for t in state["_observed"])
        state["_conditioning_cache"] = ValueCache(size=1)
        return state

    # ------------------------------------------------------------------ the conditioned GP
    def _conditioning(self) -> tuple[Tensor, Tensor, Tensor]:
        r"""``(X, L, α)``: the observed inputs in the model's dtype, the lower Cholesky factor :math:`L` of
        :math:`K(X, X) + \Sigma` and :math:`\alpha = (K(X, X) + \Sigma)^{-1} (Y - m(X))`, at the current
        :math:`\mu`, :math:`s` and noise.

        Differentiable (and recomputed at every call) when gradients are enabled and one of those, or the
        observations, requires grad; otherwise computed without a graph and cached, keyed by the values of
        everything it depends on, so a change is never missed."""
        x_obs, y_obs = self._observed
        q = self.variational_distribution
        noise = noise_variance(self.likelihood)
        names = set(self.linearized.names)
        fixed = [t for n, t in self.net.named_parameters() if n not in names]
        state = [*q.means().values(), *q.variances().values(), noise, *fixed, *self.net.buffers()]

        def compute() -> tuple[Tensor, Tensor, Tensor]:
            reference = self._reference()
            # integer inputs (token ids, packed rows of a dict) keep their dtype: only floating ones are converted
            x = x_obs.to(reference) if x_obs.is_floating_point() else x_obs.to(reference.device)
            y = y_obs.to(reference)
            residual = (y - self.mean_module(x).reshape(y.shape)).reshape(-1)
            k = self.covar_module(x).to_dense()
            sigma = noise.to(k).repeat(x.shape[0])  # interleaved: entry m·C + c is task c's noise
            factor = cholesky(k + torch.diag(sigma), name="K(X, X) + noise of the observations")
            return x, factor, torch.cholesky_solve(residual[:, None], factor)[:, 0]

        if torch.is_grad_enabled() and any(t.requires_grad for t in [*state, x_obs, y_obs]):
            return compute()
        with torch.no_grad():  # nothing kept holds a graph (the kernel's features build one internally)
            return self._conditioning_cache.get_or_compute("conditioning", [x_obs, y_obs], compute, state)

    def _distribution(self, x: Tensor) -> MultivariateNormal:
        r"""The GP at flat inputs ``x``; on a conditioned model, with :math:`(X, L, \alpha)` of
        :meth:`_conditioning`, its posterior: mean :math:`m(x) + K(x, X) \alpha`, covariance
        :math:`K(x, x) - A^\top A` with :math:`A = L^{-1} K(X, x)` (lazy: the diagonal never forms the
        ``(N·C)²`` matrix)."""
        mean, covar = self.mean_module(x), self._kernel_now()(x)  # μ, s now: read later, still these
        if self._observed is None:
            return self._mvn(mean, covar)
        x_obs, factor, alpha = self._conditioning()
        cross = self.covar_module(x, x_obs).to_dense()  # K(x, X), (N·C, M·C), interleaved
        root = torch.linalg.solve_triangular(factor, cross.mT, upper=False)  # L⁻¹ K(X, x), (M·C, N·C)
        mean = mean + (cross @ alpha).reshape(mean.shape)
        return self._mvn(mean, covar - RootLinearOperator(root.mT))

    def _matheron(self) -> MatheronUpdate:
        """Matheron's rule in weight space for this conditioned model, at the current μ, s and noise."""
        x_obs, factor, _ = self._conditioning()
        q = self.variational_distribution
        y = self._observed[1].to(factor)
        # the network's own input shape (x_obs is GPyTorch's flat form)
        return MatheronUpdate(self.linearized, q.means(), q.variances(), self.prepare(x_obs), y, factor,
                              noise_variance(self.likelihood).to(factor))


class MatheronUpdate:
    r"""Matheron's rule in weight space: :math:`\theta \mapsto \theta + \operatorname{diag}(s^2) J_\mu(X)^\top
    (K(X, X) + \Sigma)^{-1} (Y - f(X; \mu) - J_\mu(X)(\theta - \mu) - \epsilon)`, with the features of
    :math:`X` (for :math:`J_\mu u`, never the Jacobian) and the VJP of the network at :math:`\mu` on :math:`X`
    (for :math:`J_\mu^\top v`) computed once for all draws. Differentiable in :math:`\mu`, :math:`s`, the noise
    and :math:`X` when gradients are enabled (as the factor :math:`L` from ``FSVI._conditioning`` then is)."""

    def __init__(self, linearized: LinearizedNetwork, means: Mapping[str, Tensor], variances: Mapping[str, Tensor],
                 x: Tensor, y: Tensor, factor: Tensor, noise: Tensor) -> None:
        grad = torch.is_grad_enabled()
        self.linearized, self.means, self.variances, self.factor = linearized, dict(means), dict(variances), factor
        self.features = linearized.features(self.means, x, create_graph=grad)
        # f(X; μ) and v ↦ J_μ(X)ᵀ v; torch.func composes with the surrounding autograd (and ignores no_grad)
        outputs, self._vjp = torch.func.vjp(lambda params: linearized.forward(params, x), self.means)
        self.residual = (y.reshape(outputs.shape) - outputs).reshape(-1)  # Y - f(X; μ), interleaved
        self.shape = outputs.shape
        self.scale = noise.repeat(x.shape[0]).sqrt()  # entry m·C + c: task c's noise standard deviation

    def noise(self, generator: torch.Generator | None = None) -> Tensor:
        r""":math:`\epsilon \sim N(0, \Sigma)` ``(M·C,)``, interleaved."""
        z = torch.randn(self.scale.shape, dtype=self.scale.dtype, device=self.scale.device, generator=generator)
        return self.scale * z

    def __call__(self, theta: Mapping[str, Tensor], eps: Tensor) -> dict[str, Tensor]:
        shift = self.linearized.jvp(self.features, {n: theta[n] - m for n, m in self.means.items()})
        r = self.residual - shift.reshape(-1) - eps.to(self.residual).reshape(-1)
        v = torch.cholesky_solve(r[:, None], self.factor)[:, 0]
        (pulled,) = self._vjp(v.reshape(self.shape))
        return {n: theta[n] + self.variances[n] * pulled[n] for n in self.means}
