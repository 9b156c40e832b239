r"""The per-group Grams of SFR arranged as the systems it solves: joint (one ``M·C`` system) or independent outputs.

* ``"joint"``: ``(G, 1, N1·C, N2·C)``, interleaved rows and columns (``n·C + c``);
* ``"independent"``: ``(G, C, N1, N2)``, the diagonal output blocks :math:`[K_g]_{(n,c),(m,c)}`.

They come from :class:`~ntkgp.ntk.NTKEngine`, unweighted by :math:`\delta`. The inducing inputs' features are
computed in float64 whatever the network's dtype, on a float64 copy of a float32 network (:func:`precise_engine`,
whose weights are exactly the network's), once per model (:func:`inducing_features`), and kept in float64: their
Gram :math:`K_{ZZ}` (:func:`inducing_grams`) is float64, and so are the cross-Grams :math:`K_{Zx}` of the data and
test points, whose float32 features are promoted and contracted against them in float64
(:mod:`ntkgp.ntk.grams`). A float32 network's SFR is then the float64 model evaluated at the float32 features of
``x`` (its Jacobian rows :math:`J(x) + \Delta J(x)`, each within a few :math:`\epsilon_{32}` of its norm): the
rounding moves :math:`V = W K_{Zx} = Q J(x)^\top` (:math:`Q = W J(Z)` with orthonormal rows) by at most
:math:`\lVert\Delta J(x)\rVert`, whatever the condition of :math:`K_{ZZ}`, where a rounding of :math:`J(Z)` or
of the products would be amplified by up to :math:`\sqrt{\operatorname{tr}K_{ZZ}/s_{\min}}` (docs/sfr.md,
"float32"). :math:`K_{ZZ}`'s small eigenvalues decide which inducing directions SFR can use; a Gram formed in
float32 resolves them only down to about :math:`\epsilon_{32}\operatorname{tr} K_{ZZ}`, a float64 one down to
:math:`\epsilon_{64}\operatorname{tr} K_{ZZ}`. The cost for a float32 network: the copy (``P`` float64 numbers
while the ``M`` inducing inputs pass through it, once per model), the inducing features held in float64 (twice
their float32 bytes, within :data:`INDUCING_FEATURE_BYTES`), each chunk's features promoted to float64 for the
contraction (``8·C·P_c`` bytes per point of the chunk beside its float32 pass) and the contractions themselves in
float64 (at float64's rate: about half of float32's on x86 CPUs and data-centre GPUs, a small fraction of it on
consumer GPUs; the network's passes stay float32).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor

from ... import memory
from ...memory import SFR_STEP_BYTES, chunk_rows
from ...linalg import NumericalWarning
from ...ntk import NTKEngine
from ...ntk.feature_pass import FeatureSet, chunk_for_budget, contracted_width
from ...ntk.inputs import to as to_network
from ...options import OutputCoupling, choose
from ...progress import Progress, reporting
from .whitening import _symmetrize_

__all__ = [
    "auto_chunk_size", "combined_system_gram", "feature_split", "inducing_feature_bytes", "inducing_features",
    "inducing_grams", "rows_per_step",
    "network_features", "precise_engine", "system_grams", "system_grams_and_diagonal",
]


def system_grams(
    engine: NTKEngine, x1: Tensor, x2: Tensor | None, coupling: OutputCoupling | str, x1_features: FeatureSet | None = None
) -> Tensor:
    r"""Per-group Grams arranged as the systems SFR solves, unweighted by :math:`\delta`.

    * ``"joint"``: ``(G, 1, N1·C, N2·C)``, interleaved rows and columns;
    * ``"independent"``: ``(G, C, N1, N2)``, the diagonal output blocks :math:`[K_g]_{(n,c),(m,c)}`.

    ``"independent"`` uses :meth:`NTKEngine.output_grams` (only the diagonal output blocks are formed when
    every parameter takes the engine's structured route: ``C`` times fewer flops than the full Gram).
    ``x1_features``: the engine's :meth:`~ntkgp.ntk.NTKEngine.feature_set` of ``x1`` (not recomputed); ``x2=None``:
    the symmetric Gram of ``x1``.
    """
    return system_grams_and_diagonal(engine, x1, x2, coupling, with_diagonal=False, x1_features=x1_features)[0]


def system_grams_and_diagonal(
    engine: NTKEngine, x1: Tensor, x2: Tensor | None, coupling: OutputCoupling | str, with_diagonal: bool = True,
    x1_features: FeatureSet | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`system_grams` and the per-group diagonal blocks ``K_g(x2_n, x2_n)``, ``(G, N2, C, C)``.

    For independent outputs the grams and the diagonal come from :meth:`NTKEngine.output_grams` (only the
    output-diagonal entries of the blocks, which are all that coupling uses); otherwise from
    :meth:`NTKEngine.group_grams` and :meth:`NTKEngine.diag_blocks` (with ``x1_features``, both from one pass
    over ``x2``).
    """
    if choose(OutputCoupling, coupling, "output_coupling") is OutputCoupling.INDEPENDENT:
        if not with_diagonal:
            return engine.output_grams(x1, x2, x1_features=x1_features), None
        grams, diag = engine.output_grams(x1, x2, with_diagonal=True, x1_features=x1_features)
        return grams, torch.diag_embed(diag)
    if x1_features is not None and with_diagonal:
        full, blocks = engine.group_grams(x1, x2, x1_features=x1_features, with_blocks=True)
        return full.unsqueeze(1), blocks
    full = engine.group_grams(x1, x2, x1_features=x1_features)
    return full.unsqueeze(1), engine.diag_blocks(x2) if with_diagonal else None


def combined_system_gram(
    engine: NTKEngine, z: Tensor, coupling: OutputCoupling | str, weights: Tensor, rows: int, dtype: torch.dtype,
    z_features: FeatureSet | None = None, progress: bool | None = False,
) -> Tensor:
    r""":math:`K_{ZZ} = \sum_g w_g K_{g,ZZ}` arranged as :func:`system_grams` of ``(Z, Z)``, ``(1, nb, K, K)``.

    Built ``rows`` inducing inputs (columns) at a time, so that the ``G`` per-group Grams are never held at
    once (``G·K·rows·C'`` numbers per step instead of ``G·K²``), and symmetrized in place.

    Args:
        engine: the NTK engine; z: the inducing inputs ``(M, *example)``, prepared.
        coupling: output coupling.
        weights: group weights :math:`1/\delta`, ``(G,)``.
        rows: inducing inputs per step.
        dtype: of the result (the statistics' dtype; the Grams are computed in the network's).
        z_features: the engine's :meth:`~ntkgp.ntk.NTKEngine.feature_set` of ``z`` (not recomputed).
        progress: over the inducing inputs (:class:`~ntkgp.progress.Progress`, ``"SFR K_ZZ"``).
    """
    joint = choose(OutputCoupling, coupling, "output_coupling") is OutputCoupling.JOINT
    m, c = z.shape[0], engine.num_outputs(z)
    size, per_point = (m * c, c) if joint else (m, 1)
    out = torch.empty(1 if joint else c, size, size, dtype=dtype, device=engine.device)
    with Progress(m, "SFR K_ZZ", progress, unit="point") as bar:
        for s in range(0, m, rows):
            e = min(s + rows, m)
            grams = system_grams(engine, z, z[s:e], coupling, z_features)  # (G, nb, K, (e - s)·C')
            out[..., s * per_point : e * per_point] = torch.tensordot(weights.to(out), grams.to(out), dims=1)
            bar.update(e - s)
    _symmetrize_(out)
    return out.unsqueeze(0)


def rows_per_step(engine: NTKEngine, z: Tensor, coupling: OutputCoupling, budget: int | None = None) -> int:
    """SFR's points per step and prediction chunk for the prepared inducing inputs ``z``: the ``G`` float64
    cross-Grams within :data:`~ntkgp.memory.SFR_STEP_BYTES` (``G·M·C`` numbers per point, ``G·M·C²`` with joint
    coupling) or, when inducing inputs are recomputed in windows (:func:`feature_split` of ``budget``), within a
    quarter of a window's features (an eighth of the budget), so that a step is long against the window and the
    recomputation of ``Z``, once per step, is small against the step's passes over its points."""
    z = to_network(z, engine.dtype, z.device)  # (a model converted to another dtype keeps its network's)
    c, m, g = engine.num_outputs(z), z.shape[0], engine.num_groups
    per_point = g * m * c * (c if coupling is OutputCoupling.JOINT else 1) * 8
    rows = chunk_rows(SFR_STEP_BYTES, per_point, 1)
    window = feature_split(engine, z, budget)[1]
    return max(rows, window * _float64_feature_bytes(engine, z) // (4 * per_point)) if window else rows


def precise_engine(engine: NTKEngine) -> NTKEngine:
    """``engine`` itself for a float64 network; for a lower precision, an engine on a float64 copy of its network
    (the same weights, exactly; the same groups, routes and chunks). The user's network is not touched. A network
    that cannot be copied keeps ``engine``, with a ``NumericalWarning`` (its ``K_ZZ`` then resolves less)."""
    if torch.finfo(engine.dtype).eps <= torch.finfo(torch.float64).eps:
        return engine
    try:
        net = copy.deepcopy(engine.net).to(torch.float64)
    except Exception as error:  # noqa: BLE001 - any module that refuses a copy: fall back, and say so
        warnings.warn(
            f"SFR could not copy the network to form K_ZZ in float64 ({type(error).__name__}: {error}); K_ZZ is "
            f"formed in {engine.dtype}, which resolves fewer inducing directions (sfr.inducing_rank). A network "
            "that copy.deepcopy accepts, or a float64 network, avoids this.",
            NumericalWarning,
            stacklevel=4,
        )
        return engine
    return NTKEngine(
        net, engine.prior_structure, chunk_size=engine.chunk_size, strategy=engine.strategy,
        input_shape=engine.input_shape, max_jacobian_bytes=engine.core.max_jacobian_bytes,
    )


#: SFR holds its inducing inputs' layer features (:func:`inducing_features`) up to this many bytes at once, counted in
#: the dtype they are kept in (float64): per inducing input ``C·P_c`` numbers for the contracted columns (convolutions
#: and generic parameters) plus the linear layers' ``Σ d_in + C Σ d_out`` (:func:`inducing_feature_bytes`); beyond it
#: half are kept and the others recomputed in windows of the other half (:func:`feature_split`)
#: (:data:`ntkgp.memory.INDUCING_FEATURE_BYTES`).
INDUCING_FEATURE_BYTES = memory.INDUCING_FEATURE_BYTES


def inducing_feature_bytes(engine: NTKEngine, z: Tensor) -> int:
    """The bytes of one inducing input's layer features in the engine's dtype, for the prepared ``z``: ``C·P_c``
    contracted columns and ``Σ d_in + C·Σ d_out`` for the single-location (linear) layers."""
    plan, c = engine.plan(z), engine.num_outputs(z)
    width = contracted_width(engine.core, plan)  # 0 without contracted features
    single = sum(la.fan_in + c * la.d_out for la in plan.single)
    return (c * width + single) * (torch.finfo(engine.dtype).bits // 8)


def auto_chunk_size(engine: NTKEngine, probe: Tensor) -> int:
    r"""SFR's default ``chunk_size``: the examples whose feature pass fits in
    :data:`~ntkgp.ntk.feature_pass.CHUNK_BYTES` (1 GiB; :func:`~ntkgp.ntk.feature_pass.chunk_for_budget`), at most
    1,024, for inputs shaped like the prepared ``probe``."""
    return chunk_for_budget(engine.core, engine.plan(probe), engine.num_outputs(probe), probe.element_size())


def inducing_features(engine: NTKEngine, z: Tensor, progress: bool | None = False,
                      budget: int | None = None) -> tuple[FeatureSet, NTKEngine]:
    r"""The layer features of the inducing inputs on :func:`precise_engine` (float64, for :math:`K_{ZZ}`), computed
    once per model, and that engine: the contracted columns of all of them or, beyond ``budget`` bytes (default
    :data:`INDUCING_FEATURE_BYTES`; counted in float64), of the leading ones within half of it kept, the others
    recomputed at each use (in float64) in windows of the other half (:func:`feature_split`).
    ``progress``: over the chunks of ``z`` (the model's option; :func:`~ntkgp.progress.reporting`, ``"SFR inducing
    inputs"``)."""
    precise = precise_engine(engine)
    z = to_network(engine.prepare(z, "inducing_points").detach(), precise.dtype, z.device)
    keep, window = feature_split(precise, z, budget)
    with reporting(precise.core, progress, "SFR inducing inputs"):
        return precise.feature_set(z, keep=keep, window=window), precise


def feature_split(engine: NTKEngine, z: Tensor, budget: int | None = None) -> tuple[int, int]:
    r"""How a budget of ``budget`` bytes (default :data:`INDUCING_FEATURE_BYTES`) of float64 features is spent on the
    prepared inducing inputs ``z``: ``(kept, window)`` points. When all of ``Z`` fits, every point is kept
    (``window = 0``); otherwise the leading points within half of it are kept for the model's life and the other
    half is the window in which the others are recomputed, once per pass over many chunks
    (:mod:`ntkgp.ntk.feature_windows`): the features held at any moment stay within the budget."""
    points = (INDUCING_FEATURE_BYTES if budget is None else budget) // max(1, _float64_feature_bytes(engine, z))
    if points >= z.shape[0]:
        return points, 0
    return points // 2, points - points // 2


def _float64_feature_bytes(engine: NTKEngine, z: Tensor) -> int:
    """:func:`inducing_feature_bytes` counted in float64 whatever the engine's dtype."""
    return inducing_feature_bytes(engine, z) * 8 // (torch.finfo(engine.dtype).bits // 8)


def network_features(engine: NTKEngine, exact: FeatureSet) -> FeatureSet:
    """The inducing inputs' features for the cross-Grams of the network's own passes: ``exact``
    (:func:`inducing_features`) itself, in float64 also for a float32 network (the data's and test points' float32
    features are promoted and contracted against them in float64; module doc)."""
    return exact


def inducing_grams(
    z: Tensor, coupling: OutputCoupling | str, dtype: torch.dtype, features: tuple[FeatureSet, NTKEngine],
    weights: Tensor | None = None, rows: int = 1, progress: bool | None = False,
) -> tuple[Tensor, torch.dtype]:
    r""":math:`K_{ZZ}` per group, :func:`system_grams` ``(G, nb, K, K)``, or (``weights`` given, combined statistics)
    :math:`\sum_g w_g K_{g,ZZ}` ``(1, nb, K, K)`` (:func:`combined_system_gram`), in ``dtype``, computed in float64
    (:func:`precise_engine`); and the dtype it was computed in. ``features``: the float64 features of ``z`` and their
    engine (:func:`inducing_features`), reused. ``progress``: over the pass (the model's option, ``"SFR K_ZZ"``:
    :mod:`ntkgp.progress`)."""
    exact, precise = features
    z = to_network(z, precise.dtype, z.device)  # integer token ids stay integer
    if weights is not None:
        return combined_system_gram(precise, z, coupling, weights.to(precise.dtype), rows, dtype, exact,
                                    progress), precise.dtype
    with reporting(precise.core, progress, "SFR K_ZZ"):
        return system_grams(precise, z, None, coupling, exact).to(dtype), precise.dtype
