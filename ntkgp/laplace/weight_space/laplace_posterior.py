r"""Weight-space Laplace posteriors :math:`N(\theta^*, (H + P_0)^{-1})` of a trained network.

:func:`laplace_posterior` is the front door; the structures:

- :class:`FullLaplace`: dense GGN or empirical Fisher (small :math:`P`; the exact reference);
- :class:`KFACLaplace`: one Kronecker block per ``Linear``/``Conv2d`` layer, the prior added exactly through
  the eigendecompositions of the factors;
- :class:`DiagLaplace`: diagonal GGN or empirical Fisher;
- ``subset="last_layer"``: :class:`LastLayerLaplace` (full), :class:`LastLayerKFACLaplace`,
  :class:`LastLayerDiagLaplace`: one layer (default the last) from its features, one forward pass over the data;
- ``subset="subnetwork"``: :class:`SubnetLaplace`, a full posterior over chosen parameters or coordinates.

Each gives products with :math:`\Sigma`, samples :math:`\eta \sim N(0, \Sigma)`, :math:`\log|\Sigma^{-1}|` and
the GLM covariance at test inputs, for per-group prior precisions and the likelihood's current noise or
temperature (:class:`WeightPosterior`). :func:`ntkgp.laplace.predict` turns any of them into a predictive.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ...ntk.outputs import with_output
from ...options import Structure, Subset, choose
from ..ggn.data_pass import Data
from .full.laplace import FullLaplace
from .posterior.weight_posterior import WeightPosterior
from .structures import LAST_LAYER_CLASSES, STRUCTURE_CLASSES
from .subnetwork.laplace import SubnetLaplace


def laplace_posterior(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    structure: str = "kfac",
    subset: str = "all",
    prior_precision: float | Tensor = 1.0,
    prior_structure: str | Mapping[str, str] = "layer",
    output: str | int | None = None,
    **kwargs,
) -> WeightPosterior:
    r"""The Laplace posterior of ``net`` at its current weights, for the curvature ``structure``.

    Args:
        net: the trained network ``(N, *input_shape) -> (N, C)``; never modified.
        x: training inputs, or an iterable of ``(x_b, y_b)`` batches with ``y=None``.
        y: training targets.
        likelihood: a supported likelihood.
        structure: ``"full_ggn"``, ``"full_ef"``, ``"kfac"`` (default), ``"diag_ggn"`` or ``"diag_ef"``.
        subset: ``"all"`` (default), ``"last_layer"`` (a posterior of any ``structure`` over one layer, default the
            last: ``layer=`` names another) or ``"subnetwork"`` (a full posterior over ``subnetwork=``, a list of
            parameter names or a mapping name → boolean mask; ``structure`` must be ``"full_ggn"`` or
            ``"full_ef"``).
        prior_precision: :math:`\delta`, a float or one per group.
        prior_structure: ``"layer"``, ``"network"``, ``"parameter"`` or a mapping name → group.
        output: for a network returning a dict or a tuple, the key or index of the output to use
            (:mod:`ntkgp.ntk.outputs`).
        **kwargs: passed to the class (``options``, a :class:`~ntkgp.laplace.weight_space.PassOptions` with
            ``batch_size``, ``chunk_size`` and ``progress``; ``input_shape``, ``damping`` for KFAC, ``layer`` for the
            last layer, ``subnetwork`` for a subnetwork).

    Returns:
        a :class:`FullLaplace`, :class:`KFACLaplace`, :class:`DiagLaplace`, :class:`LastLayerLaplace`,
        :class:`LastLayerKFACLaplace`, :class:`LastLayerDiagLaplace` or :class:`SubnetLaplace`.

    Raises:
        ValueError: for an unknown ``structure`` or ``subset``, a subnetwork posterior with a structure other than
            a full one or without ``subnetwork``.

    Example:
        >>> posterior = laplace_posterior(net, x, y, SoftmaxLikelihood(10), structure="kfac")
        >>> prediction = ntkgp.laplace.predict(posterior, x_test, method="glm", link="probit")
    """
    net = with_output(net, output)  # a network returning a dict or tuple: its output output= (ntkgp.ntk.outputs)
    structure = choose(Structure, structure, "structure")
    subset = choose(Subset, subset, "subset")
    common = {"prior_precision": prior_precision, "prior_structure": prior_structure, **kwargs}
    classes = STRUCTURE_CLASSES[structure]
    if subset is Subset.LAST_LAYER:
        cls, arguments = LAST_LAYER_CLASSES[structure]
        return cls(net, x, y, likelihood, **arguments, **common)
    if subset is Subset.SUBNETWORK:
        if classes.posterior is not FullLaplace:
            raise ValueError(
                f"subset='subnetwork' needs structure='full_ggn' or 'full_ef', got {structure.value!r}"
            )
        if "subnetwork" not in common:
            raise ValueError("subset='subnetwork' needs subnetwork= (parameter names or name → boolean mask)")
        return SubnetLaplace(net, x, y, likelihood, **classes.posterior_arguments, **common)
    return classes.posterior(net, x, y, likelihood, **classes.posterior_arguments, **common)


__all__ = ["laplace_posterior"]
