r"""What a weight-space Laplace posterior offers beyond its algebra: its predictive, samples of functions, and
its state (:math:`\delta` and the curvature factors) to save and restore without another pass over the data.

The state dict holds only tensors, strings, numbers and lists (``torch.save`` / ``torch.load(weights_only=True)``
both work): the structure, the parameter names, shapes and prior groups, :math:`\delta`, and the curvature the
posterior was built from, as the curvature writes itself (:meth:`~ntkgp.laplace.weight_space.Curvature.state`:
:class:`~ntkgp.laplace.weight_space.FullCurvature`'s components, :class:`~ntkgp.laplace.weight_space.KroneckerGGN`'s
factors, a diagonal's components; with the training outputs and targets its evidence needs). Memory: that of the
curvature (:math:`KP^2`, :math:`\sum_l d_a^2 + K d_{out}^2` or :math:`KP` numbers) plus :math:`N(C + 1)`.

This base imports no approximation: each posterior class names the curvature classes it is restored from
(:attr:`PosteriorState.curvature_classes`), and each of them reads itself back
(:meth:`~ntkgp.laplace.weight_space.Curvature.from_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ....likelihoods import is_gaussian
from ...ggn.curvature import Curvature
from .predictive_estimators import Prediction, predict

__all__ = ["PosteriorState"]

#: Function-sample methods of :meth:`PosteriorState.predictive_samples` → :func:`predict`'s ``method``.
SAMPLE_METHODS = {"glm": "glm_mc", "nn": "nn_sampling"}


class PosteriorState:
    """The predictive, function samples and the state dict of a
    :class:`~ntkgp.laplace.weight_space.WeightPosterior` (module docstring)."""

    #: The curvature classes the posterior is restored from, by the ``structure`` their state names: each
    #: approximation names its own (module docstring).
    curvature_classes: ClassVar[Mapping[str, type[Curvature]]] = {}

    def predict(self, x: Tensor, method: str = "glm", link: str | None = None, **kwargs) -> Prediction:
        r"""The predictive at ``x``: :func:`ntkgp.laplace.predict` (every estimator: ``method="glm"``,
        ``"glm_mc"``, ``"mc_glm"``, ``"nn_sampling"``; ``link="probit"``, ``"bridge"``, ``"mc"``; the other
        keyword arguments as there). laplace-torch's ``la(x, pred_type=..., link_approx=...)``. Its pass over the
        test points follows the posterior's ``progress`` (its ``PassOptions.progress``) unless ``progress=`` is
        given.

        Example:
            >>> posterior = KFACLaplace(net, x, y, SoftmaxLikelihood(10),
            ...                         options=ntkgp.laplace.PassOptions(progress=False))
            >>> prediction = posterior.predict(x_test, link="probit")
            >>> tuple(prediction.probs.shape)                 # (N, C) class probabilities
            (1000, 10)
        """
        kwargs.setdefault("progress", getattr(self, "progress", None))
        return predict(self, x, method=method, link=link, **kwargs)

    def predictive_samples(self, x: Tensor, n_samples: int = 100, method: str = "glm",
                           generator: torch.Generator | None = None) -> Tensor:
        r"""Samples of the function at ``x``, ``(S, N, C)``: ``method="glm"`` (default) the linearized network
        :math:`f(x;\theta^*) + J(x)\eta_s`, ``"nn"`` the network :math:`f(x;\theta^* + \eta_s)`, with
        :math:`\eta_s \sim N(0, \Sigma)` shared by all test points (each sample is one function). laplace-torch's
        ``predictive_samples`` returns, for classification, ``torch.softmax(samples, -1)`` of these.

        Raises:
            ValueError: for an unknown ``method``, or ``n_samples`` not a positive integer (``"nn"``: >= 2).
        """
        if method not in SAMPLE_METHODS:
            raise ValueError(f"method must be one of {tuple(SAMPLE_METHODS)}, got {method!r}")
        link = None if is_gaussian(self.likelihood) else "mc"
        return predict(self, x, method=SAMPLE_METHODS[method], link=link, num_samples=n_samples,
                       generator=generator, progress=getattr(self, "progress", None)).samples

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        r"""The posterior's state: :math:`\delta`, the parameter names and groups, the curvature factors and the
        options fixed at construction (module docstring). Restore it with :meth:`load_state_dict` or
        :meth:`from_state_dict` on the same network at the same weights: no pass over the data.

        Raises:
            NotImplementedError: for a posterior built without a curvature object.
        """
        curvature = getattr(self, "evidence_curvature", None)
        if curvature is None or "from_curvature" not in type(self).__dict__:
            raise NotImplementedError(f"{type(self).__name__} has no state dict (no curvature object it is restored "
                                      "from)")
        return {"class": type(self).__name__, "structure": self.structure, "names": list(self.names),
                "prior_precision": self.prior_precision.clone(), "curvature": curvature.state(),
                "options": self._state_options()}

    def _state_options(self) -> dict:
        """Options fixed at construction that the state restores (KFAC: ``damping``)."""
        return {}

    @classmethod
    def from_state_dict(cls, state: Mapping, net: nn.Module, likelihood: Likelihood,
                        input_shape: tuple[int, ...] | None = None, chunk_size: int = 256):
        """The posterior saved by :meth:`state_dict`, on ``net`` (at the weights it was built at) and
        ``likelihood``, without a pass over the data.

        Raises:
            ValueError: for a state of another class, or a network whose parameters (names, shapes, norms) are
                not those the curvature was computed at.
        """
        if "from_curvature" not in cls.__dict__:
            raise NotImplementedError(f"{cls.__name__} has no state dict (no curvature object it is restored from)")
        curvature = _checked_curvature(cls, state, net)
        return cls.from_curvature(curvature, net, likelihood, state["prior_precision"], input_shape=input_shape,
                                  chunk_size=chunk_size, **state.get("options", {}))

    def load_state_dict(self, state: Mapping) -> None:
        """Replace :math:`\\delta` and the curvature by those of ``state`` (:meth:`state_dict` of a posterior of
        the same class over the same parameters), everything checked before anything changes.

        Raises:
            ValueError: as :meth:`from_state_dict`.
        """
        fresh = type(self).from_state_dict(state, self.function.net, self.likelihood,
                                           self.function.input_shape, self.function.chunk_size)
        self.__dict__.update(fresh.__dict__)


def _checked_curvature(cls: type, state: Mapping, net: nn.Module) -> Curvature:
    """The curvature of ``state`` after checking the class and that ``net`` is the network it belongs to."""
    if not isinstance(state, Mapping) or not {"class", "names", "prior_precision", "curvature"} <= set(state):
        raise ValueError("state must be a posterior's state_dict() (class, names, prior_precision, curvature)")
    if state["class"] != cls.__name__:
        raise ValueError(f"state is that of a {state['class']}, not of a {cls.__name__}")
    structure = state["curvature"]["structure"]
    if structure not in cls.curvature_classes:
        raise ValueError(f"unknown curvature structure {structure!r} in the state dict of a {cls.__name__} (one of "
                         f"{sorted(cls.curvature_classes)})")
    curvature = cls.curvature_classes[structure].from_state(state["curvature"])
    names = list(curvature.groups.names)
    params = dict(net.named_parameters())
    shapes = [tuple(params[n].shape) if n in params else None for n in names]
    if shapes != [tuple(s) for s in curvature.groups.shapes]:
        raise ValueError(f"net's parameters {names} do not have the shapes the state was saved with")
    norms = torch.zeros_like(curvature.theta_sq_norms).index_add_(
        0, torch.tensor(curvature.groups.group_of, device=curvature.theta_sq_norms.device),
        torch.stack([params[n].detach().to(curvature.theta_sq_norms).square().sum() for n in names]))
    # the curvature belongs to θ*: the same weights give the same norms up to the rounding of a sum of squares
    # (relative ε·√P at most a few 1e-5 in float32); another state of the network differs far more
    tolerance = 1e-4 if curvature.dtype == torch.float32 else 1e-10
    if not torch.allclose(norms, curvature.theta_sq_norms, rtol=tolerance, atol=0):
        raise ValueError("net's weights are not those the curvature of the state was computed at")
    return curvature
