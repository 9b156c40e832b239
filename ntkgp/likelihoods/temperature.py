"""Likelihood temperature :math:`T`: a tempered likelihood :math:`p(y \\mid f)^{1/T}` (``docs/math.md``,
"Temperature").

Tempering scales :math:`\\log p`, :math:`g = \\nabla_f \\log p` and :math:`\\Lambda = -\\nabla_f^2 \\log p` by
:math:`1/T`; it enters the Laplace quantities (evidence, posterior) only. The conditional
``likelihood(f)`` and the predictive ``likelihood(mvn)`` use the untempered link, as laplace-torch does.
"""

from __future__ import annotations

import numbers
from functools import partial, singledispatch

import torch
from gpytorch.constraints import Interval, Positive
from gpytorch.likelihoods import Likelihood
from gpytorch.priors import Prior
from torch import Tensor

from ..options import OptionAttribute
from ..validation import flag

#: ``learn_temperature``'s check: a bool, else ``ValueError``.
_flag = partial(flag, error=ValueError)


class TemperatureMixin:
    r"""Adds a positive hyperparameter :math:`T` (``raw_temperature`` with a ``Positive()`` constraint).

    Call :meth:`_register_temperature` in ``__init__`` after ``super().__init__()``.

    Attributes:
        temperature (torch.Tensor): :math:`T`, shape ``()``; the setter accepts a positive real number (any
            ``numbers.Real`` such as ``numpy.float32``, but not ``bool``) or a one-element tensor, and raises
            ``TypeError`` or ``ValueError`` otherwise.
        learn_temperature (bool): whether ``raw_temperature`` requires grad; assigning it sets that flag (as
            building the likelihood with it does). ``temperature_prior`` and ``raw_temperature_constraint`` are
            GPyTorch's registered prior and constraint (replace them with ``register_prior`` /
            ``register_constraint``, or build a new likelihood).
    """

    learn_temperature = OptionAttribute(_flag, on_change="_learn_temperature_changed")

    def _learn_temperature_changed(self, name: str) -> None:
        self.raw_temperature.requires_grad_(self.learn_temperature)

    def _register_temperature(
        self,
        temperature: float,
        learn_temperature: bool,
        temperature_prior: Prior | None,
        temperature_constraint: Interval | None,
    ) -> None:
        learn_temperature = _flag(learn_temperature, "learn_temperature")
        if temperature_constraint is None:
            temperature_constraint = Positive()
        self.register_parameter(
            name="raw_temperature",
            parameter=torch.nn.Parameter(torch.zeros(()), requires_grad=learn_temperature),
        )
        self.learn_temperature = learn_temperature
        self.register_constraint("raw_temperature", temperature_constraint)
        if temperature_prior is not None:
            self.register_prior("temperature_prior", temperature_prior, lambda m: m.temperature)
        self.temperature = temperature

    @property
    def temperature(self) -> Tensor:
        return self.raw_temperature_constraint.transform(self.raw_temperature)

    def fixed_temperature(self) -> float | None:
        """:math:`T` as a number where it is not learned (``raw_temperature`` does not require grad), else ``None``.

        The constraint's transform runs once per value of ``raw_temperature`` and constraint object, not at every
        call: a hyperparameter step of the evidence reads :math:`T` once, and GPyTorch's transform (a module call)
        costs more than the rest of a structured evidence's bookkeeping. The value is read at every call, so any
        change of it (the setter, ``initialize``, ``load_state_dict``, an in-place write) is seen."""
        # the registries of torch.nn.Module (where register_parameter / register_constraint put them): a step reads
        # them once each, and Module.__getattr__'s search costs more than the rest of this method
        raw = self._parameters["raw_temperature"]
        if raw.requires_grad:
            return None
        value, constraint = raw.item(), self._modules["raw_temperature_constraint"]
        memo = self.__dict__.get("_fixed_temperature")
        if memo is None or memo[0] != value or memo[1] is not constraint:
            memo = self.__dict__["_fixed_temperature"] = (value, constraint, float(constraint.transform(raw)))
        return memo[2]

    @temperature.setter
    def temperature(self, value: float | Tensor) -> None:
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
            raise TypeError(f"temperature must be a positive number, got {type(value).__name__}")
        value = torch.as_tensor(value).to(self.raw_temperature)
        if value.numel() != 1:
            raise ValueError(f"temperature must be a scalar, got shape {tuple(value.shape)}")
        value = value.reshape(self.raw_temperature.shape)
        if not bool(torch.isfinite(value) & (value > 0)):
            raise ValueError(f"temperature must be positive and finite, got {value.item()}")
        self.initialize(raw_temperature=self.raw_temperature_constraint.inverse_transform(value))


@singledispatch
def likelihood_temperature(likelihood: Likelihood) -> Tensor | None:
    """The temperature :math:`T` of ``likelihood``.

    Args:
        likelihood: any GPyTorch likelihood.

    Returns:
        :math:`T` (shape ``()``), or ``None`` where it has none (:math:`T = 1`).

    Example:
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> likelihood_temperature(SoftmaxLikelihood(2, temperature=0.5)).item()
        0.5
    """
    return None


@likelihood_temperature.register
def _(likelihood: TemperatureMixin) -> Tensor | None:
    return likelihood.temperature
