r"""The interface every weight-space Laplace posterior implements.

A Laplace posterior over the weights :math:`\theta` of a trained network is the Gaussian

.. math::
    q(\theta) = N(\theta^*, \Sigma), \qquad \Sigma^{-1} = H(s) + P_0, \qquad
    P_0 = \operatorname{diag}(\delta_{g(p)}),

with :math:`H(s)` a structured GGN or empirical Fisher at :math:`\theta^*` that follows the likelihood's
output scale :math:`s` (``1/σ²`` for Gaussian likelihoods, ``1/T`` for a tempered classification
likelihood, see ``docs/math.md``, "Laplace-GGN evidence") and :math:`\delta_g` one prior precision per
parameter group. It is evaluated for the *current* prior precisions and likelihood hyperparameters: change
either and the next call uses the new values (the factorizations are cached by value, never recomputed from
the data).

Every posterior gives products with :math:`\Sigma` and :math:`\Sigma^{-1}`, samples
:math:`\eta \sim N(0, \Sigma)`, :math:`\log|\Sigma^{-1}|`, and the two quantities the GLM predictive
needs at test inputs :math:`x`:

.. math::
    J(x) \Sigma J(x)^\top \ \text{per point, } (N, C, C), \qquad
    R(x) \text{ with } R R^\top = J(X) \Sigma J(X)^\top \ \text{(joint)}, (N, C, R).

Flat vectors (``(P,)``, ``(P, k)``, samples ``(S, P)``) are in the order of :attr:`names`, each parameter
flattened row-major: :meth:`NetworkCore.unflatten` splits them.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from ....caching import ValueCache, network_key, same_values
from ...ggn.scaling import output_scale
from ....likelihoods import num_outputs
from ....ntk.inputs import split
from ....ntk import ParameterGroups, resolve_groups
from ....options import OptionAttribute, PriorStructure, choose
from ....ntk.network import NetworkCore
from ....ntk.prior_precision import prior_precision_vector
from ....validation import exact_names, positive_int
from .pass_options import pass_settings
from .posterior_state import PosteriorState
from .prior_tuning import PriorTuning


def prior_groups(fn: NetworkCore, prior_structure: str | Mapping[str, str]) -> ParameterGroups:
    """The prior-precision groups of the parameters :math:`\\theta` of ``fn``.

    Args:
        fn: the network function.
        prior_structure: ``"network"`` (one :math:`\\delta`), ``"layer"`` (one per module), ``"parameter"``
            (one per parameter tensor), or a mapping from each name in ``fn.names`` to a group label.

    Raises:
        ValueError: for an unknown structure, or a mapping that does not name exactly ``fn.names``.
    """
    if isinstance(prior_structure, Mapping):
        exact_names(prior_structure, fn.names, "prior_structure", "every parameter of the posterior")
        labels = [str(prior_structure[n]) for n in fn.names]
    else:
        structure = choose(PriorStructure, prior_structure, "prior_structure").value
        trainable = resolve_groups(fn.net, structure)
        label = {n: trainable.group_names[g] for n, g in zip(trainable.names, trainable.group_of)}
        frozen = [n for n in fn.names if n not in label]
        if frozen:
            raise ValueError(
                f"the parameters {frozen} have requires_grad=False; a posterior needs trainable ones"
            )
        labels = [label[n] for n in fn.names]
    group_names = tuple(dict.fromkeys(labels))
    index = {g: i for i, g in enumerate(group_names)}
    return ParameterGroups(
        names=tuple(fn.names),
        shapes=tuple(fn.shapes),
        group_of=tuple(index[label] for label in labels),
        group_names=group_names,
    )


def check_likelihood(likelihood: Likelihood, argument: str = "likelihood") -> Likelihood:
    """``likelihood``, after checking that it is a supported GPyTorch likelihood (errors name ``argument``)."""
    if not isinstance(likelihood, Likelihood):
        raise TypeError(f"{argument} must be a gpytorch Likelihood, got {type(likelihood).__name__}")
    num_outputs(likelihood)  # raises for an unsupported likelihood
    return likelihood


def check_name(value: object, argument: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a string, got {type(value).__name__}")
    return value


def group_spec(prior_structure: str | Mapping[str, str]) -> str | Mapping[str, str]:
    """``prior_structure`` as the curvature builders take it: a mapping as it is, a name validated by
    :class:`~ntkgp.options.PriorStructure` (a member or its string)."""
    if isinstance(prior_structure, Mapping):
        return prior_structure
    return choose(PriorStructure, prior_structure, "prior_structure").value


def check_before_pass(
    net,
    likelihood: Likelihood,
    prior_precision: float | Tensor,
    prior_structure: str | Mapping[str, str],
    input_shape,
    chunk_size: int,
    names: list[str] | None = None,
) -> tuple[NetworkCore, ParameterGroups]:
    """What a posterior checks before its pass over the data (which runs the network): the likelihood, the
    network, ``chunk_size``, ``prior_structure`` and ``prior_precision``, each error naming its argument.

    Returns:
        The network function over ``names`` (default: every trainable parameter) and its prior groups.
    """
    check_likelihood(likelihood)
    fn = NetworkCore(net, names, input_shape, chunk_size)
    groups = prior_groups(fn, prior_structure)
    prior_precision_vector(prior_precision, groups, fn.dtype, fn.device, keep_graph=False)
    return fn, groups


class WeightPosterior(PriorTuning, PosteriorState, ABC):
    r"""A Gaussian Laplace posterior :math:`N(\theta^*, (H(s) + P_0)^{-1})` over (some of) a network's
    weights.

    Args:
        function: the network as a function of :math:`\theta` (:class:`NetworkCore`).
        likelihood: the likelihood the curvature was computed with; its current noise or temperature sets
            :math:`s` at every evaluation.
        groups: the prior-precision groups of :math:`\theta`.
        prior_precision: :math:`\delta`, a positive float or one per group ``(G,)``.
        scale_size: the length of :math:`s` the curvature is split for (``C`` for Gaussian likelihoods,
            ``1`` otherwise).

    The front door :func:`~ntkgp.laplace.weight_space.laplace_posterior` returns one; beside the algebra below it
    offers the evidence :meth:`log_marginal_likelihood`, :meth:`optimize_prior_precision`, :meth:`predict`,
    :meth:`predictive_samples` and :meth:`state_dict` / :meth:`load_state_dict`
    (:mod:`~ntkgp.laplace.weight_space.posterior.prior_tuning`, :mod:`~ntkgp.laplace.weight_space.posterior.posterior_state`).

    ``prior_precision`` and the likelihood's hyperparameters may change at any time (everything computed from
    them is cached by value); ``likelihood`` and ``structure`` are fixed at construction (assigning another value
    raises ``AttributeError``: the curvature was computed with them).

    Raises:
        ValueError: for a non-positive prior precision, or one of the wrong shape.
    """

    likelihood = OptionAttribute(check_likelihood, fixed="the curvature was computed with this likelihood")
    structure = OptionAttribute(check_name, fixed="a posterior of another structure is another object")
    #: The progress of :meth:`predict`'s pass over the test points (and :meth:`predictive_samples`'): the
    #: constructor's ``PassOptions.progress``; ``None`` (auto) for a posterior made from a curvature or a state
    #: dict. ``True`` (a bar), ``False`` (silent) or ``None``; it can be assigned: :mod:`ntkgp.progress`.
    progress: bool | None = None

    def _pass_settings(self, options) -> tuple[int, int, bool | None]:
        """``(batch_size, chunk_size, progress)`` of the constructor's ``PassOptions`` (:func:`pass_settings`), its
        ``progress`` kept for :meth:`predict`'s pass over the test points."""
        batch_size, chunk_size, self.progress = pass_settings(options)
        return batch_size, chunk_size, self.progress

    def __init__(
        self,
        function: NetworkCore,
        likelihood: Likelihood,
        groups: ParameterGroups,
        prior_precision: float | Tensor,
        scale_size: int,
    ) -> None:
        self.likelihood = likelihood
        self.function = function
        self.groups = groups
        self.scale_size = int(scale_size)
        self.column_groups = groups.column_groups(device=function.device)
        self.prior_precision = prior_precision
        self._cache = ValueCache(size=2)
        # what the curvature was computed at: every later use checks that the network still has it
        self._network_at_build = [t.detach().clone() for t in self._network_key()]

    def _network_key(self) -> list[Tensor]:
        """:func:`~ntkgp.caching.network_key`: the parameters the posterior is over and the buffers themselves,
        and a fingerprint of every other parameter (a frozen body under a last-layer posterior is not copied)."""
        named = dict(self.function.net.named_parameters())
        return network_key(self.function.net, [named[n] for n in self.function.names], named.values())

    def check_network(self) -> None:
        """Raise ``RuntimeError`` if the network's parameters (trainable or frozen) or buffers changed since the
        posterior was built (compared by value: optimizer steps, ``.data`` writes and ``load_state_dict`` are
        all seen): its curvature belongs to the old weights, and would be mixed with the new Jacobians."""
        if not same_values(self._network_at_build, self._network_key()):
            raise RuntimeError(
                f"the network's weights changed after this {type(self).__name__} was built; its curvature "
                "belongs to the old weights and would be mixed with the new Jacobians: build a new posterior "
                "(or restore the weights)"
            )

    def __deepcopy__(self, memo: dict) -> WeightPosterior:
        """A copy that predicts as this posterior: it shares the network (held by reference, as every model's copy
        does: the structured forms hook its layers, which must be the modules the network calls) and copies
        everything else (δ, the likelihood, the curvature), so that changing the copy's hyperparameters leaves
        this posterior as it is."""
        net = self.function.net
        shared = {id(obj): obj for obj in (*net.modules(), *net.parameters(), *net.buffers())}
        # a memo of its own, so that the network is shared here even where an enclosing deepcopy copies it (as
        # NetworkCore always shares it) and stays copied there; what else was copied is passed back
        inner = {**memo, **shared}
        new = object.__new__(type(self))
        inner[id(self)] = memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, inner))
        memo.update({k: v for k, v in inner.items() if k not in shared and k != id(inner) and k not in memo})
        return new

    # ------------------------------------------------------------------ hyperparameters
    @property
    def prior_precision(self) -> Tensor:
        r""":math:`\delta`, one per group, shape ``(G,)``; set a float (shared) or a ``(G,)`` tensor."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._prior_precision = prior_precision_vector(
            value, self.groups, self.function.dtype, self.function.device, keep_graph=False
        )

    def prior_precision_columns(self) -> Tensor:
        r""":math:`\delta_{g(p)}` for every coordinate, shape ``(P,)``."""
        return self.prior_precision[self.column_groups]

    def scale(self) -> Tensor:
        r"""The likelihood's current output scale :math:`s`, shape ``(scale_size,)``, detached."""
        s = output_scale(self.likelihood).detach().to(dtype=self.function.dtype, device=self.function.device)
        if s.shape != (self.scale_size,):
            raise ValueError(
                f"the posterior's curvature was computed for a likelihood with an output scale of size "
                f"{self.scale_size}, but {type(self.likelihood).__name__} now has one of size {s.shape[0]}"
            )
        return s

    def cached(self, tag: str, compute):
        """``compute()`` cached for the current values of :math:`\\delta` and :math:`s` (after
        :meth:`check_network`)."""
        self.check_network()
        return self._cache.get_or_compute(tag, [], compute, state=[self.prior_precision, self.scale()])

    # ------------------------------------------------------------------ basic properties
    @property
    def names(self) -> list[str]:
        """The parameters :math:`\\theta` the posterior is over, in the order of flat vectors."""
        return self.function.names

    @property
    def num_params(self) -> int:
        """:math:`P`."""
        return self.function.num_params

    @property
    def num_outputs(self) -> int:
        """:math:`C`, the likelihood's number of outputs."""
        return num_outputs(self.likelihood)

    def mean(self) -> Tensor:
        r""":math:`\theta^*`, flat ``(P,)``."""
        self.check_network()
        return self.function.theta()

    def _matrix(self, v: Tensor, argument: str) -> tuple[Tensor, bool]:
        if not torch.is_tensor(v) or v.dim() not in (1, 2) or v.shape[0] != self.num_params:
            shape = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
            raise ValueError(
                f"{argument} must have shape ({self.num_params},) or ({self.num_params}, k), got {shape}"
            )
        v = v.to(dtype=self.function.dtype, device=self.function.device)
        self.check_network()
        return (v if v.dim() == 2 else v.unsqueeze(-1)), v.dim() == 1

    def precision_matmul(self, v: Tensor) -> Tensor:
        r""":math:`(H(s) + P_0) v` for ``v`` of shape ``(P,)`` or ``(P, k)``."""
        m, vector = self._matrix(v, "v")
        out = self._precision_matmul(m)
        return out.squeeze(-1) if vector else out

    def covariance_matmul(self, v: Tensor) -> Tensor:
        r""":math:`\Sigma v = (H(s) + P_0)^{-1} v` for ``v`` of shape ``(P,)`` or ``(P, k)``."""
        m, vector = self._matrix(v, "v")
        out = self._covariance_matmul(m)
        return out.squeeze(-1) if vector else out

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        r"""Draws :math:`\eta_s \sim N(0, \Sigma)` (deviations from :math:`\theta^*`), shape ``(S, P)``."""
        num_samples = positive_int(num_samples, "num_samples")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.check_network()
        z = torch.randn(
            num_samples,
            self.num_params,
            dtype=self.function.dtype,
            device=self.function.device,
            generator=generator,
        )
        return self._sample(z)

    def sample_from(self, z: Tensor) -> Tensor:
        r"""The sampler's linear map :math:`\eta = B z` (:math:`B B^\top = \Sigma`) applied to given standard
        normal draws ``z`` ``(S, P)``, shape ``(S, P)``: what :meth:`sample` does with its own draws."""
        if not torch.is_tensor(z) or z.dim() != 2 or z.shape[1] != self.num_params:
            shape = tuple(z.shape) if torch.is_tensor(z) else type(z).__name__
            raise ValueError(f"z must have shape (S, {self.num_params}), got {shape}")
        return self._sample(z.to(dtype=self.function.dtype, device=self.function.device))

    def dense_covariance(self) -> Tensor:
        r""":math:`\Sigma` as a dense ``(P, P)`` matrix (small :math:`P` only: for tests and inspection)."""
        eye = torch.eye(self.num_params, dtype=self.function.dtype, device=self.function.device)
        return self._covariance_matmul(eye)

    def glm_covariance(self, x: Tensor) -> Tensor:
        r"""The GLM predictive covariance :math:`J(x_n) \Sigma J(x_n)^\top` of each test point, ``(N, C, C)``.

        ``x`` is checked and prepared; computed in chunks of ``function.chunk_size`` examples.
        """
        self.check_network()
        x = self.function.prepare(x)
        return torch.cat([self._glm_covariance(xc) for xc in split(x, self.function.chunk_size)])

    def glm_root(self, x: Tensor) -> Tensor:
        r"""A root :math:`R(X)`, ``(N, C, R)``, of the joint GLM covariance:
        :math:`R R^\top = J(X) \Sigma J(X)^\top` with rows in interleaved order ``n·C + c``.

        Memory :math:`O(NCR)` with :math:`R \le P` (:math:`R = P` except where stated by the structure).
        """
        self.check_network()
        x = self.function.prepare(x)
        return torch.cat([self._glm_root(xc) for xc in split(x, self.function.chunk_size)])

    # ------------------------------------------------------------------ what each structure implements
    @abstractmethod
    def _precision_matmul(self, v: Tensor) -> Tensor:
        """``(H + P0) v`` for ``v`` of shape ``(P, k)``."""

    @abstractmethod
    def _covariance_matmul(self, v: Tensor) -> Tensor:
        """``Σ v`` for ``v`` of shape ``(P, k)``."""

    @abstractmethod
    def _sample(self, z: Tensor) -> Tensor:
        """``η = B z`` with ``B Bᵀ = Σ`` for standard normal ``z`` of shape ``(S, P)``; returns ``(S, P)``."""

    @abstractmethod
    def log_det_precision(self) -> Tensor:
        r""":math:`\log|H(s) + P_0|` (:math:`= -\log|\Sigma|`), shape ``()``."""

    @abstractmethod
    def dense_precision(self) -> Tensor:
        r""":math:`H(s) + P_0` as a dense ``(P, P)`` matrix (small :math:`P` only)."""

    @abstractmethod
    def _glm_covariance(self, x: Tensor) -> Tensor:
        """Per-point ``J Σ Jᵀ`` for a prepared chunk ``x``, ``(n, C, C)``."""

    @abstractmethod
    def _glm_root(self, x: Tensor) -> Tensor:
        """A joint root for a prepared chunk ``x``, ``(n, C, R)``."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(P={self.num_params}, groups={list(self.groups.group_names)}, "
            f"prior_precision={self.prior_precision.tolist()})"
        )
