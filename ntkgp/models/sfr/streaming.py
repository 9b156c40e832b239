r"""Streaming the data into :class:`~ntkgp.models.sfr.statistics.DualStatistics`, batch by batch.

Each batch needs the network's outputs :math:`f_n`, the cross-Grams :math:`K_g(Z, x_n)` and point blocks
(:mod:`~ntkgp.models.sfr.system_grams`) and, for the linearized prior mean, the **offset**
:math:`o_n = f_n - m_n = J(x_n)\theta^*` (one forward-mode product, the Jacobian is never formed): the offset is
computed directly, never as :math:`f_n - (f_n - J_n\theta^*)`, so that no quantity is formed by cancellation.

The network's numbers (outputs, Grams, offsets) come in the network's dtype; the sums are accumulated in
:func:`~ntkgp.models.sfr.statistics.statistics_dtype` (float64 for a float32 network), in which their rounding
is negligible next to that of the features (docs/sfr.md, "float32").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from ...likelihoods import is_gaussian, validate_targets
from ...ntk import NTKEngine
from ...ntk.feature_pass import FeatureSet
from ...ntk.feature_windows import windows
from ...options import OutputCoupling, PriorMean
from ...progress import Progress, reporting
from .statistics import DualStatistics, statistics_dtype
from .validation import InputLayout, data_names, refuse_graph

__all__ = ["CountedBatches", "counted", "mean_offset", "stream_statistics"]


def mean_offset(engine: NTKEngine, x: Tensor, f: Tensor, kind: PriorMean) -> Tensor:
    r"""The offset :math:`o(x) = f(x) - m(x)` of the prior mean at prepared inputs ``x`` with network outputs ``f``
    ``(N, C)``: :math:`f(x)` for the zero mean, :math:`J(x)\theta^*` for the linearized mean (a Jacobian-vector
    product in the network's dtype; no gradients)."""
    if kind is PriorMean.ZERO:
        return f
    return engine.jvp(x, engine.params()).reshape(f.shape)


def _step(engine: NTKEngine, z: Tensor, xb: Tensor, coupling: OutputCoupling, mean: PriorMean,
          z_features: FeatureSet) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""The outputs, offsets, cross-Grams and point blocks of one step, all from one feature pass over ``xb``
    against the inducing inputs' features (:meth:`NTKEngine.output_grams <ntkgp.ntk.NTKEngine.output_grams>` for
    independent outputs, :meth:`NTKEngine.group_grams <ntkgp.ntk.NTKEngine.group_grams>` for joint coupling, with
    ``with_outputs``: :math:`J(x)\theta^*` from the layer features, no forward or Jacobian-vector product of
    its own)."""
    if coupling is OutputCoupling.INDEPENDENT:
        cross, diag, f, linearized = engine.output_grams(z, xb, with_diagonal=True, x1_features=z_features,
                                                         with_outputs=True)
        diag = torch.diag_embed(diag)
    else:  # joint: the full Grams, the point blocks and the outputs from the same pass
        cross, diag, f, linearized = engine.group_grams(z, xb, x1_features=z_features, with_blocks=True,
                                                        with_outputs=True)
        cross = cross.unsqueeze(1)
    return f, (f if mean is PriorMean.ZERO else linearized), cross, diag


def stream_statistics(
    engine: NTKEngine,
    likelihood: Likelihood,
    z: Tensor,
    coupling: OutputCoupling,
    mean: PriorMean,
    batches: Iterable[tuple[Tensor, Tensor]],
    layout: InputLayout,
    rows: int,
    argument: str,
    progress: bool | None = False,
    *,
    z_features: FeatureSet,
    prior_precision: Tensor | None = None,
) -> DualStatistics:
    r"""Fresh :class:`DualStatistics` of ``batches`` at inducing inputs ``z`` (nothing else is changed).

    Args:
        engine: the NTK engine of the network.
        likelihood: the model's likelihood.
        z: inducing inputs ``(M, *example)``.
        coupling: output coupling.
        mean: prior mean.
        batches: checked ``(x, y)`` pairs (:func:`~ntkgp.models.sfr.validation.training_batches`).
        layout: the examples' layout (every batch is checked against it).
        rows: points per accumulation step.
        argument: prefix for error messages (``"train"``, ``"new"``).
        progress: ``None`` (auto), ``True`` (a bar) or ``False`` (silent) over the points (:mod:`ntkgp.progress`;
            the estimate needs their number: :func:`counted`).
        prior_precision: ``None`` (statistics per group), or the :math:`\delta` at which the groups are combined
            (``statistics="combined"``, :class:`DualStatistics`).
        z_features: the engine's :meth:`~ntkgp.ntk.NTKEngine.feature_set` of ``z``, computed once per model.

    Returns:
        The statistics (raises before returning anything if any batch is bad).

    Raises:
        NotImplementedError: for new inputs (``argument="new"``, :meth:`SFR.update <ntkgp.models.sfr.SFR.update>`)
            that require grad: the sums carry no graph, so a gradient with respect to them would be silently zero.
    """
    name_x, name_y = data_names(argument)
    c = engine.num_outputs(z)
    dtype = statistics_dtype(engine.dtype)
    stats = DualStatistics(
        engine.num_groups, z.shape[0], c, coupling, is_gaussian(likelihood), dtype, z.device, prior_precision
    )
    # with windows of recomputed inducing inputs a step passes its points several times (ntk.feature_windows), each
    # pass long: those passes report as the model's option asks; otherwise only the steps do
    inner = progress if windows(z_features) else False
    with Progress(getattr(batches, "num_points", None), "SFR dual statistics", progress, unit="point") as bar, \
            reporting(engine.core, inner, "SFR dual statistics"):
        for x, y in batches:
            if argument == "new":
                refuse_graph(x, name_x)
            with torch.no_grad():
                x = engine.prepare(layout.check(x, name_x)[0], name_x)
                validate_targets(likelihood, y, c, num_data=x.shape[0], name=name_y)
                for s in range(0, x.shape[0], rows):
                    xb, yb = x[s : s + rows], y[s : s + rows]
                    f, offset, cross, diag = _step(engine, z, xb, coupling, mean, z_features)
                    stats.accumulate(likelihood, cross.to(dtype), diag.to(dtype), f.to(dtype), offset.to(dtype), yb)
                    bar.update(xb.shape[0])
    if int(stats.num_data) == 0:
        raise ValueError(f"{name_x} holds no data")
    return stats


class CountedBatches:
    """``(x, y)`` batches and the number of points they hold (``num_points``; ``None`` when unknown), so that a
    pass over them can estimate its time (:class:`~ntkgp.progress.Progress`)."""

    def __init__(self, batches: Iterable[tuple[Tensor, Tensor]], num_points: int | None) -> None:
        self.batches, self.num_points = batches, num_points

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return iter(self.batches)


def counted(data: object, batches: Iterable[tuple[Tensor, Tensor]], first: tuple | None = None) -> CountedBatches:
    """``batches`` (after ``first``, when given) with the number of points of ``data``: the rows of a tensor, the
    length of a loader's dataset, else unknown. Nothing is read from ``data``."""
    if torch.is_tensor(data):
        num_points = int(data.shape[0])
    else:
        try:
            num_points = len(data.dataset)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            num_points = None
    return CountedBatches(batches if first is None else itertools.chain([first], batches), num_points)
