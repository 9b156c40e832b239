r"""The common interface of the scalable Laplace-GGN curvature structures and the evidence they give.

A :class:`Curvature` is computed once from the network at :math:`\theta^*` and the training data; it then
evaluates, for any prior precisions :math:`\delta_g` and likelihood hyperparameters (noise, temperature),

.. math::
    \log q(\mathcal D) = \sum_n \log p(y_n \mid f_n) - \tfrac12 \sum_g \delta_g \|\theta^*_g\|^2
    + \tfrac12 \sum_g P_g \log \delta_g - \tfrac12 \log|H + P_0|,

with :math:`H` the structured approximation of :math:`\sum_n J_n^\top \Lambda_n J_n` (or of the empirical
Fisher) and :math:`P_0 = \operatorname{diag}(\delta)` expanded to :math:`P \times P` (``docs/math.md``,
"Laplace-GGN evidence"): the Laplace approximation of the log marginal likelihood. Nothing that scales with :math:`N` or needs the network is recomputed: the likelihood's
hyperparameters enter through the output scale :math:`s` (:func:`~ntkgp.laplace.ggn.scaling.output_scale`), the
data term through the stored outputs :math:`f_n`. All evaluations are differentiable w.r.t. :math:`\delta`,
the noise and the temperature.
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from functools import cached_property

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from ...ntk import ParameterGroups
from ...ntk.prior_precision import prior_precision_vector
from ..spectral_evidence import Spectrum, spectral_evidence
from .scaling import data_fit, data_fit_statistics, output_scale, variance_reader


class Curvature(ABC):
    r"""A structured curvature :math:`H \approx \sum_n J_n^\top \Lambda_n J_n` at :math:`\theta^*`, computed once.

    Args:
        groups: the prior-precision groups of the network's trainable parameters.
        theta_sq_norms: :math:`\|\theta^*_g\|^2` per group, shape ``(G,)``.
        f: network outputs :math:`f_n` at :math:`\theta^*`, shape ``(N, C)``.
        y: the training targets, normalised by :func:`~ntkgp.likelihoods.validate_targets`.
        scale_size: the length of the likelihood's output scale :math:`s` the curvature was split for
            (``C`` for Gaussian likelihoods, ``1`` otherwise).
    """

    structure: str = ""

    def __init__(
        self, groups: ParameterGroups, theta_sq_norms: Tensor, f: Tensor, y: Tensor, scale_size: int
    ) -> None:
        self.groups = groups
        self.theta_sq_norms = theta_sq_norms
        self.f = f
        self.y = y
        self.scale_size = int(scale_size)
        self.group_sizes = groups.group_sizes().to(f)
        self._fit_statistics: tuple[type, Tensor, tuple[float, ...]] | None = None
        self._variance_reader: tuple[weakref.ref, Callable[[Likelihood], Tensor | None]] | None = None

    @cached_property
    def column_groups(self) -> Tensor:
        """The group of every parameter, ``(P,)`` long (formed at the first use: KFAC's evidence needs none)."""
        return self.groups.column_groups(device=self.f.device)

    @property
    def num_data(self) -> int:
        """:math:`N`, the number of training points the curvature sums over."""
        return self.f.shape[0]

    @property
    def num_params(self) -> int:
        """:math:`P`, the number of trainable parameters."""
        return self.groups.num_params

    @property
    def dtype(self) -> torch.dtype:
        return self.f.dtype

    def prior_precision_vector(self, prior_precision: float | Tensor, check_value: bool = True) -> Tensor:
        r"""The prior precisions :math:`\delta` as a ``(G,)`` tensor (a scalar is shared by all groups), with its
        graph (:func:`~ntkgp.ntk.prior_precision.prior_precision_vector`). ``check_value=False``: a ``(G,)`` tensor of
        the curvature's dtype and device is returned without reading its values (for a caller that checks them
        itself, as the one-node evidence of one group does with the one number it reads)."""
        delta = prior_precision
        if not (isinstance(delta, Tensor) and delta.dtype == self.f.dtype and delta.shape == self.group_sizes.shape
                and delta.device == self.f.device and (not check_value or _positive_finite(delta))):
            # anything but a positive finite (G,) tensor of the curvature's dtype: the full conversion and check
            delta = prior_precision_vector(prior_precision, self.groups, self.dtype, self.f.device,
                                           keep_graph=True)
        return delta

    def scale(self, likelihood: Likelihood) -> Tensor:
        r"""The likelihood's output scale :math:`s` (``1/σ²`` or ``1/T``), shape ``(scale_size,)``."""
        s = output_scale(likelihood)
        if s.dtype != self.dtype or s.device != self.f.device:
            s = s.to(device=self.f.device, dtype=self.dtype)
        if s.shape[0] != self.scale_size:
            raise self._scale_size_error(s.shape[0], likelihood)
        return s

    def variance(self, likelihood: Likelihood) -> Tensor | float | None:
        r"""The reciprocal :math:`v = 1/s` of the output scale as the likelihood holds it (``σ²``, ``(C,)``, or
        ``T``, ``()``, in the curvature's dtype; a temperature that is not learned as a number), or ``None`` for
        :math:`s = 1` (:func:`~ntkgp.laplace.ggn.scaling.variance_reader`)."""
        reader = self._variance_reader
        if reader is None or reader[0]() is not likelihood:  # checked and dispatched once per likelihood
            reader = self._variance_reader = (weakref.ref(likelihood), variance_reader(likelihood))
        v = reader[1](likelihood)
        if not isinstance(v, Tensor):  # None (s = 1) or a number: one component
            if self.scale_size != 1:
                raise self._scale_size_error(1, likelihood)
            return v
        f = self.f
        if v.dtype != f.dtype or v.device != f.device:
            v = v.to(device=f.device, dtype=f.dtype)
        if v.numel() != self.scale_size:
            raise self._scale_size_error(v.numel(), likelihood)
        return v

    def _scale_size_error(self, size: int, likelihood: Likelihood) -> ValueError:
        return ValueError(
            f"the curvature was computed for a likelihood with an output scale of size {self.scale_size}, "
            f"but {type(likelihood).__name__} has one of size {size}; compute it again for this likelihood"
        )

    def fit_statistics(self, likelihood: Likelihood) -> Tensor:
        r"""The statistics ``(3, K)`` of the data term
        (:func:`~ntkgp.laplace.ggn.scaling.data_fit_statistics`), computed once per likelihood type from
        the stored outputs, :math:`O(NC)`."""
        return self._statistics(likelihood)[1]

    def _statistics(self, likelihood: Likelihood) -> tuple[type, Tensor, tuple[float, ...]]:
        """``(type, statistics, their first column as numbers)``, formed once per likelihood type."""
        if self._fit_statistics is None or self._fit_statistics[0] is not type(likelihood):
            statistics = data_fit_statistics(likelihood, self.f, self.y)
            self._fit_statistics = (type(likelihood), statistics, tuple(statistics[:, 0].tolist()))
        return self._fit_statistics

    def data_fit(self, likelihood: Likelihood) -> Tensor:
        r""":math:`\sum_n \log p(y_n \mid f_n)` at the likelihood's current noise or temperature, shape
        ``()``, differentiable in them: :math:`O(K)` from :meth:`fit_statistics`."""
        scale = self.scale(likelihood)
        return data_fit(self.fit_statistics(likelihood), scale)

    def diagonal_spectrum(self) -> tuple[Tensor, Tensor, int] | None:
        r"""``(u, groups, q)`` when every eigenvalue of :math:`H + P_0` is :math:`s^q u_p + \delta_{g(p)}` for the
        one output scale :math:`s` (:mod:`~ntkgp.laplace.spectral_evidence`), else ``None``."""
        return None

    @cached_property
    def _spectrum(self) -> Spectrum | None:
        """:meth:`diagonal_spectrum` with the norms, as the one-node evidence takes them (formed at the first use:
        a curvature is fixed once computed)."""
        spectrum = self.diagonal_spectrum()
        return None if spectrum is None else Spectrum(*spectrum, self.theta_sq_norms)

    @abstractmethod
    def log_det(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0|` for prior precisions ``(G,)`` (or a scalar) and the likelihood's current
        noise or temperature, shape ``()``."""

    @abstractmethod
    def dense(self, likelihood: Likelihood) -> Tensor:
        r"""The structured :math:`H` (without the prior) as a dense ``(P, P)`` matrix, columns in the order of
        ``groups.names``. For tests and small networks only."""

    def log_det_ratio(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r""":math:`\log|H + P_0| - \log|P_0|`, shape ``()``; the exact curvatures compute it directly (without the
        cancellation of the difference)."""
        delta = self.prior_precision_vector(prior_precision)
        return self.log_det(delta, likelihood) - (self.group_sizes * delta.log()).sum()

    def log_marginal_likelihood(self, prior_precision: float | Tensor, likelihood: Likelihood) -> Tensor:
        r"""The Laplace approximation of the log marginal likelihood :math:`\log q(\mathcal D)` (module
        docstring), shape ``()``, differentiable w.r.t. ``prior_precision`` and the likelihood's noise or
        temperature.

        Args:
            prior_precision: :math:`\delta`, a positive scalar (shared by all groups) or ``(G,)``.
            likelihood: the likelihood the curvature was computed for, at its current hyperparameters.

        Returns:
            The log marginal likelihood, summed over the data: divide by :attr:`num_data` to report it per
            data point. Cost: :math:`O(K)` for the data term (:meth:`data_fit`; :math:`O(NC)` once) plus that
            of :meth:`log_det`.

        Raises:
            ValueError: ``prior_precision`` of the wrong shape or not positive, or a likelihood with another
                output scale.
        """
        spectrum = self._spectrum
        if spectrum is not None:  # one node of the graph, O(P); with one group it checks δ's value itself
            delta = self.prior_precision_vector(prior_precision, check_value=spectrum.groups is not None)
            return spectral_evidence(delta, self.variance(likelihood), spectrum, self._statistics(likelihood)[2])
        delta = self.prior_precision_vector(prior_precision)
        prior = 0.5 * (delta * self.theta_sq_norms).sum()
        return self.data_fit(likelihood) - prior - 0.5 * self.log_det_ratio(delta, likelihood)

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        """The curvature as a dict of tensors, strings, numbers and lists (``torch.save`` /
        ``torch.load(weights_only=True)`` both work): the structure, the parameter groups, the norms, the stored
        outputs and targets and the output scale's size, then the structure's own factors
        (:meth:`_state_fields`): what a posterior's state dict holds to be restored without a pass over the data.

        Raises:
            NotImplementedError: for a curvature that cannot be saved (no :meth:`_state_fields`).
        """
        groups = self.groups
        state = {
            "structure": self.structure,
            "groups": {"names": list(groups.names), "shapes": [list(s) for s in groups.shapes],
                       "group_of": list(groups.group_of), "group_names": list(groups.group_names)},
            "theta_sq_norms": self.theta_sq_norms, "f": self.f, "y": self.y, "scale_size": self.scale_size,
        }
        return {**state, **self._state_fields()}

    def _state_fields(self) -> dict:
        """The structure's own factors in :meth:`state` (each saveable class gives them, with :meth:`_from_state`)."""
        raise NotImplementedError(f"no state dict for a {type(self).__name__}")

    @classmethod
    def from_state(cls, state: Mapping) -> Curvature:
        """The curvature :meth:`state` saved (its decompositions are formed again at their first use)."""
        g = state["groups"]
        groups = ParameterGroups(tuple(g["names"]), tuple(torch.Size(s) for s in g["shapes"]), tuple(g["group_of"]),
                                 tuple(g["group_names"]))
        return cls._from_state((groups, state["theta_sq_norms"], state["f"], state["y"], int(state["scale_size"])),
                               state)

    @classmethod
    def _from_state(cls, common: tuple, state: Mapping) -> Curvature:
        """The curvature from the arguments every structure takes, ``common`` (``groups, theta_sq_norms, f, y,
        scale_size``), and the fields of ``state`` that :meth:`_state_fields` wrote."""
        raise NotImplementedError(f"no state dict for a {cls.__name__}")


def _positive_finite(delta: Tensor) -> bool:
    """Whether every entry is positive and finite, from one reduction (the smallest entry positive, the largest
    finite; ``aminmax`` propagates NaN, which fails both); one entry is read as a number."""
    if delta.numel() == 1:
        value = delta.item()
        return 0 < value < math.inf
    low, high = torch.aminmax(delta.detach())
    return float(low) > 0 and float(high) < math.inf
