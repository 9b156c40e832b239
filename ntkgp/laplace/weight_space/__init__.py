r"""Weight-space Laplace: curvature structures of the GGN / empirical Fisher (``P × P`` objects or their
Kronecker / diagonal approximations), the posteriors :math:`N(\theta^*, (H + P_0)^{-1})` built on them, and every
estimator of their GLM predictive.

* :func:`compute_curvature` — one pass over the data, a :class:`Curvature` whose :meth:`~Curvature.log_det` and
  :meth:`~Curvature.log_marginal_likelihood` are cheap to re-evaluate for new prior precisions, noise or
  temperature: ``"diag_ggn"`` (:class:`DiagonalGGN`), ``"diag_ef"`` (:class:`DiagonalEF`), ``"kfac"``
  (:class:`KroneckerGGN`, no damping), ``"full_ggn"`` / ``"full_ef"`` (:class:`FullCurvature`, weight space;
  :func:`exact_curvature` builds it or :class:`FunctionSpaceCurvature`, whichever side is smaller). The names are the
  members of :class:`ntkgp.options.Structure`; :mod:`~ntkgp.laplace.weight_space.structures` is the one place
  that maps a name to its class.
* :func:`last_layer_curvature` — the full, KFAC or diagonal curvature of one layer (default the last) from its
  features, one forward pass over the data (:mod:`~ntkgp.laplace.weight_space.last_layer.curvature`).
* :func:`laplace_posterior` — the posterior front door: :class:`FullLaplace`, :class:`KFACLaplace`,
  :class:`DiagLaplace`; over one layer :class:`LastLayerLaplace`, :class:`LastLayerKFACLaplace`,
  :class:`LastLayerDiagLaplace`; over a subnetwork :class:`SubnetLaplace` (base class :class:`WeightPosterior`).
* :func:`predict` — the GLM predictive of a posterior by every estimator of the papers (closed form, GLM-MC,
  MC-GLM, network sampling; probit, bridge and MC links).

The floor plan, one folder an approximation holding its curvature and its posterior:
:mod:`~ntkgp.laplace.weight_space.full` (:class:`FullLaplace`; the full GGN / EF itself is the shared
:mod:`ntkgp.laplace.ggn`'s), :mod:`~ntkgp.laplace.weight_space.kfac` (the Kronecker blocks, their running sums over the
data, :class:`KroneckerGGN`, :class:`KFACLaplace`), :mod:`~ntkgp.laplace.weight_space.diagonal` (:class:`DiagonalGGN`,
:class:`DiagonalEF`, :class:`DiagLaplace`), :mod:`~ntkgp.laplace.weight_space.subnetwork` (:class:`SubnetLaplace`) and
:mod:`~ntkgp.laplace.weight_space.last_layer` (features, curvature, posteriors). Below them what several approximations
share: :mod:`~ntkgp.laplace.weight_space.posterior` (the interface :class:`WeightPosterior`, the evidence and choice of
:math:`\delta`, the predictive, the state dict, the pass options; it imports no approximation: each posterior class
names the curvature classes it is restored from) and :mod:`~ntkgp.laplace.weight_space.layers` (the layers a structured
curvature takes, normalization layers' diagonal, the layer Jacobians in Kronecker form at test points). Above them
the structure table (:mod:`~ntkgp.laplace.weight_space.structures`) and the front door
(:mod:`~ntkgp.laplace.weight_space.laplace_posterior`).
"""

from ..ggn import (  # the shared GGN (ntkgp.laplace.ggn), documented here where users import it
    Curvature,
    FullCurvature,
    FunctionSpaceCurvature,
    exact_curvature,
    full_curvature,
    full_ef,
    full_ggn,
    function_space_curvature,
    output_scale,
)
from .diagonal.curvature import DiagonalCurvature, DiagonalEF, DiagonalGGN, diagonal_ef, diagonal_ggn
from .diagonal.laplace import DiagLaplace
from .full.laplace import FullLaplace
from .kfac.blocks import KroneckerFactors
from .kfac.curvature import KroneckerGGN, kfac_ggn
from .kfac.laplace import KFACLaplace
from .laplace_posterior import laplace_posterior
from .last_layer.curvature import last_layer_curvature
from .last_layer.laplace import LastLayerLaplace
from .last_layer.structured import LastLayerDiagLaplace, LastLayerKFACLaplace
from .posterior.pass_options import PassOptions
from .posterior.predictive_estimators import Prediction, default_step_size, laplace_bridge, predict
from .posterior.weight_posterior import WeightPosterior
from .structures import compute_curvature
from .subnetwork.laplace import SubnetLaplace

__all__ = [
    "Curvature",
    "DiagLaplace",
    "DiagonalCurvature",
    "DiagonalEF",
    "DiagonalGGN",
    "FullCurvature",
    "FullLaplace",
    "FunctionSpaceCurvature",
    "KFACLaplace",
    "KroneckerFactors",
    "KroneckerGGN",
    "LastLayerDiagLaplace",
    "LastLayerKFACLaplace",
    "LastLayerLaplace",
    "PassOptions",
    "Prediction",
    "SubnetLaplace",
    "WeightPosterior",
    "compute_curvature",
    "default_step_size",
    "diagonal_ef",
    "diagonal_ggn",
    "exact_curvature",
    "full_curvature",
    "full_ef",
    "full_ggn",
    "function_space_curvature",
    "kfac_ggn",
    "laplace_bridge",
    "laplace_posterior",
    "last_layer_curvature",
    "output_scale",
    "predict",
]
