r"""Windows of a feature set's recomputed chunks: the chunks of a :class:`~ntkgp.ntk.feature_pass.FeatureSet` whose
contracted columns are not kept (beyond its memory budget), grouped in runs of at most
:attr:`~ntkgp.ntk.feature_pass.FeatureSet.window` points.

A cross-Gram of a set ``x1`` given by its features against other inputs ``x2`` of many chunks
(:mod:`ntkgp.ntk.grams`) contracts each chunk of ``x2`` against every point of ``x1``. Recomputing each chunk of
``x1`` that is not kept once per chunk of ``x2`` costs ``(N1 - kept)`` Jacobian rows of ``x1`` per chunk of ``x2``:
with SFR's inducing inputs on a convolutional network (thousands of them, float64) many times the pass over ``x2``
itself. With windows the loop runs the other way round for them: each window of ``x1`` is recomputed **once per
call** and held (``window · C · P_c`` numbers, one tensor per group), and ``x2`` is passed through the network again
for it, its chunks contracted against the whole window in one product each. A call then costs one pass over ``x2``
for the kept points, outputs and diagonals, plus one per window, and ``N1 - kept`` recomputed points:

.. math:: \text{passes over } x_2 = 1 + \lceil (N_1 - \text{kept}) / \text{window} \rceil.

The symmetric Gram of ``x1`` with itself (:math:`K_{ZZ}`) takes the windows in turn: each against the kept points
and itself in one product, and against the chunks of the windows before it, recomputed one chunk at a time (each
point recomputed at most once per later window, instead of once per later chunk).

Windows need the columns of every chunk in one layout (no graph to the inputs, no embedding tables' token sums);
otherwise (and with ``window = 0``, or ``x2`` of a single chunk) the chunks are recomputed one at a time, for each
chunk of ``x2``, as before.
"""

from __future__ import annotations

from .column_block import ColumnBlock
from .feature_pass import FeatureSet, chunk_features
from .held_features import Contracted
from .inputs import rows as take_rows

#: One window: its first and last point ``(s, e)`` and the indices of its chunks in ``FeatureSet.bounds``.
Window = tuple[int, int, list[int]]


def windows(f: FeatureSet) -> list[Window]:
    """The chunks of ``f`` that are not kept, in runs of at most ``f.window`` points (at least one chunk each);
    ``[]`` when ``f`` takes no windows (``window = 0``, nothing to recompute, a graph, or embedding tables)."""
    if not (f.window > 0 and f.joinable):
        return []
    out: list[Window] = []
    for k, ((s, e), cols) in enumerate(zip(f.bounds, f.kept)):
        if cols is not None:
            continue
        if out and out[-1][1] == s and e - out[-1][0] <= f.window:
            out[-1] = (out[-1][0], e, out[-1][2] + [k])
        else:
            out.append((s, e, [k]))
    return out


def window_columns(f: FeatureSet, window: Window) -> Contracted:
    """The contracted columns of the window's chunks, recomputed on ``f``'s network and written into one tensor per
    group ``{group: (n·C, P_g)}`` (rows ``n·C + c``, ``n`` the window's points) in ``f.dtype``
    (:class:`~ntkgp.ntk.column_block.ColumnBlock`, as ``f``'s held columns)."""
    s0, e0, chunks = window
    block = ColumnBlock(f.core, f.plan, e0 - s0, f.core.num_outputs(f.x), f.dtype)
    for k in chunks:
        s, e = f.bounds[k]
        rows = chunk_features(f.core, f.plan, take_rows(f.x, s, e), f.graph, single=False,
                              into=block.targets(s - s0, e - s0))
        block.join(rows, s - s0)
    return block.columns()
