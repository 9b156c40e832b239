r"""The Gaussian prior over a network's weights that FSVI maps to function space."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..ntk import resolve_groups
from ..ntk.prior_precision import prior_precision_vector
from ..options import OptionAttribute, PriorLinearization, PriorStructure, WeightPriorMean, choice, choose
from ..validation import exact_names


class GaussianParameterPrior(nn.Module):
    r"""The prior :math:`p(\theta) = N(\mu_0, \operatorname{diag}(s_0^2))` with :math:`s_{0,i}^2 = 1/\delta_g` for
    every weight :math:`i` of group :math:`g`, and where its function-space Gaussian is linearized.

    Linearizing the network about :math:`\theta_p`, :math:`f(x; \theta) \approx f(x; \theta_p) + J_{\theta_p}(x)
    (\theta - \theta_p)`, the prior induces on context points :math:`X_C`

    .. math:: p(f_C) = N\big(f(X_C; \theta_p) + J_{\theta_p}(\mu_0 - \theta_p),\;
        J_{\theta_p}(X_C) \operatorname{diag}(s_0^2) J_{\theta_p}(X_C)^\top\big),

    with :math:`\theta_p = \mu_0` (``prior_linearization="prior_mean"``, the paper's equation: mean
    :math:`f(X_C; \mu_0)`) or :math:`\theta_p = \mu`, the variational mean (``"variational_mean"``, the default).
    At :math:`\mu_0 = 0` the Jacobian of a tanh or ReLU network vanishes except for the last bias, so the
    paper's form is degenerate there. About :math:`\mu`, prior and variational distribution share one
    linearization: the function-space KL is then the weight-space KL seen through :math:`J_\mu` at the context
    points (equal to it when :math:`J_\mu` is square and invertible), with mean difference
    :math:`J_\mu(\mu - \mu_0)` that keeps regularizing :math:`\mu` (a prior mean :math:`f(X_C; \mu_0)` with a
    covariance that grows with :math:`\mu` would not).

    Args:
        net: the network (its trainable parameters define the groups; it is not stored).
        prior_precision: :math:`\delta`, a positive float or one value per group.
        prior_structure: ``"network"``, ``"layer"`` (default), ``"parameter"`` or a mapping from every
            trainable parameter name to a group label (see :func:`ntkgp.ntk.resolve_groups`).
        prior_mean: ``"zero"`` (default), ``"initial"`` (the network's weights now) or a mapping from every
            trainable parameter name to a tensor of its shape.
        prior_linearization: ``"variational_mean"`` (default) or ``"prior_mean"``; the attribute of that name
            cannot be changed afterwards (it is checked against ``prior_mean`` here: build a new prior or model).

    Raises:
        TypeError: a ``prior_precision`` that is not a number or a tensor of real numbers (a bool included).
        ValueError: an unknown option, a non-positive or wrongly shaped ``prior_precision``, a ``prior_mean``
            mapping that does not match the parameters, or ``prior_linearization="prior_mean"`` with
            ``prior_mean="zero"`` (a degenerate prior).
    """

    prior_linearization = OptionAttribute(
        choice(PriorLinearization),
        fixed="it is checked against prior_mean when the prior is built, and the model was trained with it",
    )

    def __init__(
        self,
        net: nn.Module,
        prior_precision: float | Tensor = 1.0,
        prior_structure: str | Mapping[str, str] = "layer",
        prior_mean: str | Mapping[str, Tensor] = "zero",
        prior_linearization: str = "variational_mean",
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if not isinstance(prior_structure, Mapping):
            prior_structure = choose(PriorStructure, prior_structure, "prior_structure").value
        groups = resolve_groups(net, prior_structure)
        linearization = choose(PriorLinearization, prior_linearization, "prior_linearization")
        named = dict(net.named_parameters())
        reference = named[groups.names[0]]
        precision = prior_precision_vector(prior_precision, groups, reference.dtype, reference.device,
                                           keep_graph=False)
        if isinstance(prior_mean, Mapping):
            exact_names(prior_mean, groups.names, "prior_mean")
            means = []
            for n in groups.names:
                value = torch.as_tensor(prior_mean[n])
                if value.shape != named[n].shape:
                    raise ValueError(
                        f"prior_mean[{n!r}] must have shape {tuple(named[n].shape)}, got {tuple(value.shape)}"
                    )
                means.append(value.detach().to(named[n]).clone())
            kind = None
        else:
            kind = choose(WeightPriorMean, prior_mean, "prior_mean")
            if kind is WeightPriorMean.ZERO and linearization is PriorLinearization.PRIOR_MEAN:
                raise ValueError(
                    "prior_linearization='prior_mean' with prior_mean='zero' gives a degenerate prior: at zero "
                    "weights the Jacobian vanishes except for the last bias. Use prior_linearization="
                    "'variational_mean' or a non-zero prior_mean"
                )
            source = {n: named[n].detach() for n in groups.names}
            means = [torch.zeros_like(source[n]) if kind is WeightPriorMean.ZERO else source[n].clone() for n in groups.names]
        super().__init__()
        self.names: tuple[str, ...] = groups.names
        self.group_of: tuple[int, ...] = groups.group_of
        self.group_names: tuple[str, ...] = groups.group_names
        self.prior_linearization = linearization
        self.zero_mean = kind is WeightPriorMean.ZERO
        self.register_buffer("prior_precision", precision)
        for i, m in enumerate(means):
            self.register_buffer(f"mean_{i}", m)

    def means(self) -> dict[str, Tensor]:
        r""":math:`\mu_0` per parameter name."""
        return {n: getattr(self, f"mean_{i}") for i, n in enumerate(self.names)}

    def variances(self) -> dict[str, Tensor]:
        r""":math:`s_0^2 = 1/\delta_g` per parameter name, as 0-dim tensors (one value per tensor)."""
        inverse = self.prior_precision.reciprocal()
        return {n: inverse[g] for n, g in zip(self.names, self.group_of)}
