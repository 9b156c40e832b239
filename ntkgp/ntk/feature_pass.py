r"""One pass over a chunk of inputs for everything the NTK's Grams need: the layer features of every structured
layer (one forward pass with hooks and ``C`` backward passes for the chunk, :mod:`ntkgp.ntk.features`) and the
per-example Jacobians of the generic parameters (``vmap(jacrev)``, :meth:`NetworkCore.jacobian_chunk
<ntkgp.ntk.network.NetworkCore.jacobian_chunk>`).

* a single-location layer (``nn.Linear`` on ``(N, d)`` inputs) keeps its inputs :math:`a_n` ``(n, d_in)`` and
  output gradients :math:`\gamma_{nc}` ``(n·C, d_out)``: its Grams factor (:mod:`ntkgp.ntk.structured`);
* a layer with several locations (``nn.Conv2d``: unfolded patches) sums its locations right after each
  backward pass, :math:`\sum_t \Gamma_{nct} \bar a_{nt}^\top` ``(d_out, d_a)`` per example and output (one
  batched matrix product; the gradients at every location of the ``C`` outputs are never held together), and
  is contracted with the generic parameters (:mod:`ntkgp.ntk.contraction`) as columns ``(n·C, P_g)`` per group.

* the layer plan's elementwise layers (normalization layers' affine parameters, ``nn.Embedding`` tables:
  :mod:`ntkgp.ntk.elementwise_pass`) take their rows, or their token sums, from the same passes: a normalization
  layer's ``(C, n, d)`` columns join the contracted ones, a table's :class:`~ntkgp.ntk.token_grams.TokenSums` are
  contracted as a Gram of equal tokens (:mod:`ntkgp.ntk.token_grams`).

A :class:`FeatureSet` holds the features of a whole set of inputs, chunk by chunk: the single-location ones
always (:math:`O(N(C\sum d_{out} + \sum d_{in}))` numbers), the contracted columns when they fit in
``max_jacobian_bytes`` or when asked to (``keep=True``: the features of a set used many times, as SFR's inducing
inputs; recomputed for each use otherwise), or those of as many leading chunks as a budget allows (``keep=`` a number
of points: the rest recomputed at each use, so that a set beyond the budget costs in proportion to the excess).

**Memory of one chunk** of ``n`` examples (``s`` bytes per number): the contracted columns
``n·C·P_c`` (``P_c`` = :func:`contracted_width`, the token sums of the tables included; written in place, one
product per output and layer, and twice where a consumer joins the layers' blocks into ``(n·C, P_g)`` columns:
:class:`~ntkgp.ntk.held_features.ChunkFeatures`), plus the unfolded inputs of the multi-location layers
:math:`n \sum_l d_{a,l} T_l`, the normalized inputs and one column's gradients of the normalization layers
:math:`2 n \sum_l d_l T_l`, the token ids (int64) and the per-example Jacobians of the generic parameters
(``vmap(jacrev)``, about ``3·n·C·P_g``): :func:`chunk_bytes` per example. A Gram of equal tokens adds temporaries of
at most :data:`~ntkgp.ntk.token_grams.PAIR_NUMBERS` numbers and its ``(n_1·n_2, C, C)`` block.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from ..memory import FEATURE_PASS_BYTES, chunk_rows
from . import token_grams
from .column_block import ColumnBlock
from .elementwise_pass import ElementwiseReducer, token_numbers
from .features import Layer
from .held_features import ChunkFeatures, Contracted
from .inputs import num_rows
from .inputs import rows as take_rows
from .layer_plan import LayerPlan
from .network import NetworkCore
from .norm_features import EmbeddingLayer


class _Reducer:
    r"""The ``reduce`` of the feature pass (:func:`~ntkgp.ntk.features.layer_features`): the elementwise layers'
    rows and token sums (:class:`~ntkgp.ntk.elementwise_pass.ElementwiseReducer`), the multi-location layers'
    blocks :math:`\sum_t \Gamma_{nct} \bar a_{nt}^\top`, each cotangent column's written by one batched product into
    its place in a ``(C, n, d_out, d_a)`` buffer per layer (no stack, no copy; with ``graph`` they are returned and
    stacked, differentiable); the single-location layers' gradients ``(n, d_out)``."""

    def __init__(self, plan: LayerPlan, graph: bool, group: dict[str, int], into: dict[str, Tensor] | None = None) -> None:
        self.multi, self.graph, self.into = {layer.name for layer in plan.multi}, graph, into or {}
        self.blocks: dict[str, Tensor] = {}
        self.folded: dict[str, Tensor] = {}
        self.elementwise_names = {layer.name for layer in plan.elementwise}
        self.elementwise = ElementwiseReducer(group, graph)

    def __call__(self, layer: Layer, a: Tensor, g: Tensor, m: int, count: int) -> Tensor | None:
        if layer.name in self.elementwise_names:
            return self.elementwise(layer, a, g, m, count)
        if layer.name in self.multi:
            if self.graph:
                return layer.blocks(a, g)  # (n, d_out, d_a)
            if m == 0:
                self.folded[layer.name] = layer.fold(a)
                n, d_a = a.shape[0], self.folded[layer.name].shape[1]
                shape, into = (count, n, g.shape[1], d_a), self.into.get(layer.name)
                self.blocks[layer.name] = into if into is not None and into.shape == shape else torch.empty(
                    shape, dtype=g.dtype, device=g.device)  # written in place where a target is given
            layer.blocks(self.folded[layer.name], g, out=self.blocks[layer.name][m])
            if m + 1 == count:
                del self.folded[layer.name]
            return None
        if g.shape[-1] != 1:
            raise RuntimeError(f"layer '{layer.name}' changed its number of locations since the plan was made")
        return g[..., 0]  # (n, d_out)


def _layer_parameters(layer: Layer, theta: dict[str, Tensor]) -> Tensor:
    r""":math:`\Theta = [W \mid b]` ``(d_out, d_a)`` of the layer's parameters in :math:`\theta` (the columns of
    :meth:`Layer.fold`'s :math:`\bar a`)."""
    parts = [theta[layer.weight].reshape(layer.d_out, -1)] if layer.weight is not None else []
    if layer.bias is not None:
        parts.append(theta[layer.bias][:, None])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _layer_output(layer: Layer, theta: dict[str, Tensor], a: Tensor) -> Tensor:
    r"""The part of the layer's output ``W a + b`` ``(n, d_out)`` that its parameters in :math:`\theta` make."""
    z = a @ theta[layer.weight].T if layer.weight is not None else None
    if layer.bias is not None:
        b = theta[layer.bias]
        z = b.expand(a.shape[0], -1) if z is None else z + b
    return z


def chunk_features(core: NetworkCore, plan: LayerPlan, x: Tensor, graph: bool, single: bool = True,
                   columns: bool = True, linearized: bool = False, into: dict[str, Tensor] | None = None) -> ChunkFeatures:
    r"""The features of the chunk ``x`` (prepared): those of the single-location layers (``single``) and the
    contracted features (``columns``: the columns as pieces and the token sums,
    :class:`~ntkgp.ntk.held_features.ChunkFeatures`); with ``graph`` differentiable in ``x``.

    ``linearized`` (no ``graph``, every feature): also the outputs :math:`f(x)` of the pass and :math:`J(x)\theta^*`
    from the features, layer by layer :math:`\sum_t \Gamma_{nct} \cdot (W a_{nt} + b)` (the blocks against
    :math:`\Theta`, the linear layers' gradients against their outputs, the normalization layers' rows and the
    tables' token sums against their parameters, the generic Jacobians against theirs): the Jacobian-vector product
    without another pass (``ChunkFeatures.outputs``, ``.linearized``). ``into``: per multi-location layer, the
    ``(C, n, d_out, d_a)`` tensor (a view) its blocks are written into (no graph; :class:`FeatureSet`)."""
    contracted = bool(plan.multi or plan.generic or plan.elementwise)
    if linearized and (graph or not single or not (columns or not contracted)):
        raise ValueError("linearized=True needs every feature (single=True, columns=True) and no graph")
    layers = [la for la in plan.layers if (la in plan.single and single) or (la in plan.multi and columns)]
    layers += list(plan.elementwise) if columns else []
    inputs, grads, pieces, tokens = {}, {}, {}, []
    group = dict(zip(core.groups.names, core.groups.group_of))
    theta = core.params() if linearized else {}
    outputs = jt = None
    if layers:
        reducer = _Reducer(plan, graph, group, into)
        feats = core.features(x, layers, graph=graph, reduce=reducer)
        outputs = feats.outputs
        jt = torch.zeros_like(outputs) if linearized else None
        for layer in layers:
            if layer.name in reducer.elementwise_names:
                continue
            if layer in plan.single:  # (n, C, d_out)
                g = feats.grads[layer.name]
                a = inputs[layer.name] = feats.inputs[layer.name][..., 0]
                grads[layer.name] = g.reshape(-1, g.shape[-1])
                if linearized:  # γ_c · (W a + b)
                    jt += (g @ _layer_output(layer, theta, a)[..., None]).squeeze(-1)
                continue
            # (C, n, d_out, d_a)
            block = feats.grads[layer.name].transpose(0, 1) if graph else reducer.blocks.pop(layer.name)
            if linearized:
                jt += (block.flatten(2) @ _layer_parameters(layer, theta).flatten()).T
            kinds = layer.parameter_names
            if len({group[k] for k in kinds}) == 1:
                pieces.setdefault(group[kinds[0]], []).append(block.flatten(2))
            else:  # weight and bias in two groups
                pieces.setdefault(group[layer.weight], []).append(block[..., : layer.fan_in].flatten(2))
                pieces.setdefault(group[layer.bias], []).append(block[..., layer.fan_in])
        for name, rows in reducer.elementwise.pieces().items():  # normalization layers: (C, n, d)
            pieces.setdefault(group[name], []).append(rows)
            if linearized:
                jt += (rows @ theta[name].reshape(-1)).T
        tokens = reducer.elementwise.tokens()
        if linearized:
            for t in tokens:
                jt += token_grams.linearized(t, num_rows(x), theta[t.name])
    if columns and plan.generic:
        with torch.set_grad_enabled(graph):
            jac = core.jacobian_chunk(x, plan.generic)
        for name in plan.generic:  # (n, C, numel)
            pieces.setdefault(group[name], []).append(jac[name].transpose(0, 1))
            if linearized:
                if jt is None:
                    with torch.no_grad():
                        outputs = core.forward(x)
                    jt = torch.zeros_like(outputs)
                jt += jac[name] @ theta[name].reshape(-1).to(jac[name])
    return ChunkFeatures(inputs, grads, pieces=dict(sorted(pieces.items())), outputs=outputs, linearized=jt,
                         tokens=tuple(tokens))


def contracted_width(core: NetworkCore, plan: LayerPlan) -> int:
    """The numbers per example and output of the contracted features: the columns of the multi-location layers,
    the normalization layers and the generic parameters, and at most ``T·D`` token sums per embedding table
    (:func:`~ntkgp.ntk.elementwise_pass.token_numbers`, ``T`` its locations on the probe)."""
    numel = dict(zip(core.names, core.numels))
    return (sum(numel[n] for n in plan.generic) + sum(numel[n] for la in plan.multi for n in la.parameter_names)
            + sum(token_numbers(la, plan.locations[la.name]) for la in plan.elementwise))


def chunk_bytes(core: NetworkCore, plan: LayerPlan, c: int, itemsize: int) -> int:
    """Bytes per example of one chunk's feature pass (module doc, "Memory of one chunk"): ``itemsize·(2·C·P_c +
    Σ_l d_a T_l + 2 Σ_l d_l T_l + 3·C·P_g) + 8·Σ_l T_l`` for the contracted features (:func:`contracted_width`),
    the multi-location layers' unfolded inputs, the normalization layers' normalized inputs and one column's
    gradients (``d_l`` channels), the generic parameters' Jacobians and the tables' token ids (``T_l`` the
    locations on the probe)."""
    numel = dict(zip(core.names, core.numels))
    generic = sum(numel[n] for n in plan.generic)
    unfolded = sum((layer.fan_in + 1) * plan.locations[layer.name] for layer in plan.multi)
    norms = sum(2 * _channels(la) * plan.locations[la.name] for la in plan.elementwise if not _table(la))
    ids = sum(8 * plan.locations[la.name] for la in plan.elementwise if _table(la))
    return itemsize * (2 * c * contracted_width(core, plan) + unfolded + norms + 3 * c * generic) + ids


def _table(layer: Layer) -> bool:
    return isinstance(layer, EmbeddingLayer)


def _channels(layer: Layer) -> int:
    return (layer.module.weight if layer.module.weight is not None else layer.module.bias).numel()


#: The memory one chunk's feature pass may take by default (:func:`chunk_for_budget`;
#: :data:`ntkgp.memory.FEATURE_PASS_BYTES`).
CHUNK_BYTES = FEATURE_PASS_BYTES


def chunk_for_budget(core: NetworkCore, plan: LayerPlan, c: int, itemsize: int, budget: int | None = None,
                     largest: int = 1024) -> int:
    """The examples per chunk whose feature pass fits in ``budget`` bytes (:func:`chunk_bytes`; default
    :data:`CHUNK_BYTES`), between 1 and ``largest``. E.g. the Fashion-MNIST CNN (P = 421,642; convolutions P_c = 18,816, T = 784 and 196), float32,
    C = 10: about 1.7 MB per example, 610 examples per GiB (a chunk of 1,024 on the per-example Jacobian route
    would hold ``1024·C·P`` numbers, 17 GB)."""
    budget = CHUNK_BYTES if budget is None else budget
    return chunk_rows(budget, chunk_bytes(core, plan, c, 1), itemsize, largest)


class FeatureSet:
    """The features of a set of inputs ``x`` (prepared), chunk by chunk.

    Args:
        core, plan: the network and its layer plan for ``x``.
        x: the inputs (prepared).
        graph: keep the autograd graph to ``x``.
        columns: compute the contracted columns at all.
        keep: keep the contracted columns whatever their size (``True``), never (``False``), when they fit in
            ``max_jacobian_bytes`` (``None``), or for the leading chunks that lie within the first ``keep`` points
            (an ``int``: a memory budget in points; the other chunks' columns are recomputed at each use, so that
            the cost of a set larger than the budget grows with the part that does not fit).
        window: the points of the chunks not kept that a pass over many chunks of other inputs may recompute once
            and hold together (:mod:`ntkgp.ntk.feature_windows`); ``0``: one chunk at a time, recomputed for each
            chunk of the other inputs.

    Attributes:
        bounds: ``(start, stop)`` of each chunk.
        inputs, grads: the single-location layers' features over all of ``x`` (``(N, d_in)``, ``(N·C, d_out)``).
        kept: per chunk, its contracted columns, or ``None`` where they are recomputed at each use.
        held, held_points: the kept columns of the leading ``held_points`` points in one tensor per group,
            ``{group: (held_points·C, P_g)}`` (rows ``n·C + c``; ``kept`` holds views of it), or ``None`` (nothing
            kept, a graph, or embedding tables' token sums): contracted against a chunk of other inputs in one product
            (:mod:`ntkgp.ntk.grams`), larger and faster than one per chunk.
    """

    def __init__(self, core: NetworkCore, plan: LayerPlan, x: Tensor, graph: bool, columns: bool = True,
                 keep: bool | int | None = None, window: int = 0) -> None:
        self.core, self.plan, self.x, self.graph, self.window = core, plan, x, graph, int(window)
        n, c = num_rows(x), core.num_outputs(x)
        self.contracted = columns and bool(plan.generic or plan.multi or plan.elementwise)
        if keep is None:
            keep = n * c * contracted_width(core, plan) * core.dtype.itemsize <= core.max_jacobian_bytes
        limit = (n if keep else 0) if isinstance(keep, bool) else int(keep)
        self.bounds = [(s, min(s + core.chunk_size, n)) for s in range(0, n, core.chunk_size)]
        self.dtype = core.dtype  # of the columns given out (the network's: x may hold token ids) (recomputed ones are rounded to it: :meth:`converted`)
        inputs, grads, self.kept = {}, {}, []
        held_points = sum(e - s for s, e in self.bounds if e <= limit) if self.contracted else 0
        one_block = held_points > 0 and self.joinable
        self.held, self.held_points = None, held_points if one_block else 0
        block = ColumnBlock(core, plan, held_points, c, core.dtype) if self.held_points else None
        for s, e in core.chunks(n, "layer features"):
            held = self.contracted and e <= limit
            into = block.targets(s, e) if held and block is not None else None
            f = chunk_features(core, plan, take_rows(x, s, e), graph, columns=held, into=into)
            for m in f.inputs:
                inputs.setdefault(m, []).append(f.inputs[m])
                grads.setdefault(m, []).append(f.grads[m])
            if held and block is not None:  # written into their rows of one tensor per group
                self.kept.append(block.join(f, s))
            else:
                self.kept.append(f.columns if held else None)
        self.held = None if block is None else block.columns()
        self.inputs = {m: v[0] if len(v) == 1 else torch.cat(v) for m, v in inputs.items()}
        self.grads = {m: v[0] if len(v) == 1 else torch.cat(v) for m, v in grads.items()}

    @property
    def num_points(self) -> int:
        return num_rows(self.x)

    @property
    def joinable(self) -> bool:
        """Whether the chunks' contracted columns can be written into one tensor per group (no graph, no embedding
        tables' token sums): :attr:`held` and :mod:`~ntkgp.ntk.feature_windows` need it."""
        return self.contracted and not self.graph and not any(_table(la) for la in self.plan.elementwise)

    @property
    def keep(self) -> bool:
        """Whether every chunk's contracted columns are kept (none recomputed)."""
        return self.contracted and all(cols is not None for cols in self.kept)

    @property
    def kept_points(self) -> int:
        """The number of points whose contracted columns are kept."""
        return sum(e - s for (s, e), cols in zip(self.bounds, self.kept) if cols is not None) if self.contracted else 0

    def converted(self, dtype: torch.dtype, release: bool = False) -> FeatureSet:
        """The same features in ``dtype`` (rounded once), e.g. features computed on a float64 copy of a network, used
        against a float32 network's. Chunks not kept are recomputed at each use on this set's network and rounded
        the same way (the same numbers as kept ones). ``release``: drop each of this set's kept chunks once it is
        converted (this set then recomputes them; the two copies of the columns are never held together, except those
        :attr:`held` in one tensor, released once converted whole)."""
        new = copy.copy(self)
        new.dtype = dtype
        new.inputs = {m: a.to(dtype) for m, a in self.inputs.items()}
        new.grads = {m: g.to(dtype) for m, g in self.grads.items()}
        new.held = None if self.held is None else self.held.to(dtype)
        new.kept = []
        for k, cols in enumerate(self.kept):
            s, e = self.bounds[k]
            if cols is not None and e <= self.held_points:  # views of the converted tensor, rows n·C + c
                c = next(iter(cols.values())).shape[0] // (e - s)
                new.kept.append(Contracted({g: t[s * c : e * c] for g, t in new.held.items()}))
            else:
                new.kept.append(None if cols is None else cols.to(dtype))
            if release:
                self.kept[k] = None
        if release:
            self.held, self.held_points = None, 0
        return new

    def nbytes(self) -> int:
        """The bytes held."""
        tensors = [*self.inputs.values(), *self.grads.values()]
        return (sum(t.numel() * t.element_size() for t in tensors)
                + sum(cols.nbytes() for cols in self.kept if cols is not None))

    def rows(self, start: int, stop: int, c: int) -> ChunkFeatures:
        """The single-location features of the inputs ``start:stop`` (views)."""
        return ChunkFeatures({m: a[start:stop] for m, a in self.inputs.items()},
                             {m: g[start * c : stop * c] for m, g in self.grads.items()}, Contracted())

    def columns(self, k: int) -> Contracted:
        """The contracted features of chunk ``k`` (kept, or recomputed and rounded to :attr:`dtype`)."""
        if self.kept[k] is not None:
            return self.kept[k]
        s, e = self.bounds[k]
        return chunk_features(self.core, self.plan, take_rows(self.x, s, e), self.graph, single=False).columns.to(
            self.dtype)
