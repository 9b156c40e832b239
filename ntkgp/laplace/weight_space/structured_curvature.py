"""The one place where the posteriors read :mod:`ntkgp.laplace.weight_space`: computing a KFAC or diagonal curvature
and taking its pieces (Kronecker factors per layer, diagonals) through the curvature objects' public
attributes."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from .curvature import Curvature
from .kfac import KroneckerGGN
from .structures import compute_curvature
from ...options import PriorStructure, choose
from .dense_curvature import Data


def structured_curvature(
    net: nn.Module,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    structure: str,
    prior_structure: str | Mapping[str, str],
    batch_size: int,
    progress: bool,
    input_shape: tuple[int, ...] | None,
) -> Curvature:
    """:func:`ntkgp.laplace.compute_curvature` with the prior groups given as ``prior_structure``."""
    if not isinstance(prior_structure, Mapping):
        prior_structure = choose(PriorStructure, prior_structure, "prior_structure").value
    keyword = (
        "prior_structure"
        if "prior_structure" in inspect.signature(compute_curvature).parameters
        else "groups"
    )
    return compute_curvature(
        net,
        x,
        y,
        likelihood,
        structure=structure,
        batch_size=batch_size,
        progress=progress,
        input_shape=input_shape,
        **{keyword: prior_structure},
    )


@dataclass(frozen=True)
class KroneckerBlockFactors:
    """One layer's KFAC block :math:`(\\sum_k s_k G_k) \\otimes A` as the curvature stores it.

    Attributes:
        module: the module's name; ``weight``/``bias`` its parameter names (``bias`` ``None`` when absent).
        group: the prior group of the block.
        input_factor: :math:`A`, ``(d_a, d_a)``.
        output_factors: :math:`G_k`, ``(K, d_out, d_out)``.
    """

    module: str
    weight: str
    bias: str | None
    group: int
    input_factor: Tensor
    output_factors: Tensor


def kronecker_blocks(curvature: Curvature) -> tuple[list[KroneckerBlockFactors], list[str], Tensor]:
    """The Kronecker blocks, the names of the parameters outside them, and their GGN diagonal components
    ``(K, P_rest)`` of a KFAC curvature.

    Raises:
        TypeError: when ``curvature`` is not a KFAC curvature.
    """
    if not isinstance(curvature, KroneckerGGN):
        raise TypeError(
            f"curvature must be a KFAC curvature (structure='kfac'), got {type(curvature).__name__}"
        )
    blocks = [
        KroneckerBlockFactors(b.module, b.weight, b.bias, b.group, b.input_factor, b.output_factors)
        for b in curvature.blocks
    ]
    return blocks, list(curvature.diagonal_names), curvature.diagonal_components
