"""Windows of recomputed features (ntkgp.ntk.feature_windows): a set given by its features whose columns are partly
not kept is contracted against other inputs of several chunks window by window. The Grams equal ``J(x1) J(x2)ᵀ`` by
``jacrev`` whatever is kept and however wide the windows; the passes are those the module states: each point of
``x1`` not kept recomputed once per call, ``x2`` passed once plus once per window."""

import math
from unittest import mock

import pytest
import torch

from ntkgp.ntk import NTKEngine, feature_pass
from ntkgp.ntk.feature_windows import windows
from tests.ntk.test_cnn_passes import small_fmnist_cnn
from tests.ntk.test_structured_inputs import dense_jacobian

CHUNK = 3


def setup(n1=11, n2=10):
    net = small_fmnist_cnn()
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(n1, 1, 8, 8, generator=g, dtype=torch.float64), torch.randn(n2, 1, 8, 8, generator=g,
                                                                                   dtype=torch.float64)
    return net, NTKEngine(net, "network", chunk_size=CHUNK), x1, x2


def dense(net, x1, x2):
    """``(N1·C, N2·C)`` and the per-output Grams ``(C, N1, N2)`` from dense Jacobians."""
    j1, j2 = dense_jacobian(net, x1), dense_jacobian(net, x2)
    c = j1.shape[0] // x1.shape[0]
    full = j1 @ j2.T
    per_output = torch.stack([full[i::c, i::c] for i in range(c)])
    return full, per_output


def counting(calls):
    real = feature_pass.chunk_features

    def spy(core, plan, x, *args, **kwargs):
        calls.append((x.shape[0], kwargs.get("single", True)))
        return real(core, plan, x, *args, **kwargs)
    return spy


# (kept points, window points): nothing kept, a chunk kept, windows wider than all that is left, windows narrower than
# one chunk (one chunk each), windows of two chunks
CASES = [(0, 3), (3, 3), (3, 100), (6, 1), (0, 6)]


@pytest.mark.parametrize("keep,window", CASES)
def test_cross_grams_by_windows_equal_the_dense_gram(keep, window):
    net, engine, x1, x2 = setup()
    full, per_output = dense(net, x1, x2)
    f = engine.feature_set(x1, keep=keep, window=window)
    assert f.kept_points == keep and windows(f)
    group, blocks = engine.group_grams(x1, x2, x1_features=f, with_blocks=True)
    out, diag = engine.output_grams(x1, x2, x1_features=f, with_diagonal=True)
    assert torch.allclose(group[0], full, rtol=1e-12, atol=1e-12 * full.abs().max())
    assert torch.allclose(out[0], per_output, rtol=1e-12, atol=1e-12 * full.abs().max())
    # the point blocks of x2 from the first pass (the windows add nothing to them)
    _, self_blocks = dense(net, x2, x2)
    assert torch.allclose(diag[0].T, torch.stack([b.diagonal() for b in self_blocks]), rtol=1e-12)
    assert blocks.shape == (1, x2.shape[0], 3, 3)


@pytest.mark.parametrize("keep,window", CASES)
def test_the_symmetric_gram_by_windows_equals_the_dense_gram(keep, window):
    net, engine, x1, _ = setup()
    full, per_output = dense(net, x1, x1)
    f = engine.feature_set(x1, keep=keep, window=window)
    assert torch.allclose(engine.group_grams(x1, None, x1_features=f)[0], full, rtol=1e-12,
                          atol=1e-12 * full.abs().max())
    assert torch.allclose(engine.output_grams(x1, None, x1_features=f)[0], per_output, rtol=1e-12,
                          atol=1e-12 * full.abs().max())


@pytest.mark.parametrize("keep,window", CASES)
def test_each_point_not_kept_is_recomputed_once_and_x2_passed_once_per_window(keep, window):
    net, engine, x1, x2 = setup()
    f = engine.feature_set(x1, keep=keep, window=window)
    wins = windows(f)
    # the module's count: the windows hold at most `window` points, or one chunk where a chunk is wider
    assert sum(e - s for s, e, _ in wins) == x1.shape[0] - keep
    assert all(e - s <= max(window, CHUNK) for s, e, _ in wins)
    x2_calls, x1_calls = [], []
    with mock.patch("ntkgp.ntk.grams.chunk_features", counting(x2_calls)), \
            mock.patch("ntkgp.ntk.feature_windows.chunk_features", counting(x1_calls)):
        engine.output_grams(x1, x2, x1_features=f)
    # x1: each point not kept once, its columns only; x2: once with every feature, then once per window (columns)
    assert sorted(n for n, _ in x1_calls) == sorted(e - s for s, e in f.bounds[keep // CHUNK :])
    assert not any(single for _, single in x1_calls)
    assert sum(n for n, single in x2_calls if single) == x2.shape[0]
    assert sum(n for n, single in x2_calls if not single) == x2.shape[0] * len(wins)


def test_one_chunk_of_x2_and_window_zero_recompute_chunk_by_chunk():
    # window 0, or x2 within one chunk: no windows, each chunk not kept recomputed for each chunk of x2
    net, engine, x1, x2 = setup()
    full, _ = dense(net, x1, x2[:CHUNK])
    for window, other in [(0, x2), (6, x2[:CHUNK])]:
        f = engine.feature_set(x1, keep=3, window=window)
        calls = []
        with mock.patch("ntkgp.ntk.feature_pass.chunk_features", counting(calls)), \
                mock.patch("ntkgp.ntk.grams.chunk_features", counting(calls)):
            out = engine.group_grams(x1, other, x1_features=f)
        x2_chunks = math.ceil(other.shape[0] / CHUNK)
        assert len([1 for n, single in calls if not single]) == x2_chunks * 3  # 8 points not kept: chunks of 3, 3, 2
    assert torch.allclose(out[0], full, rtol=1e-12, atol=1e-12 * full.abs().max())


def test_window_is_checked():
    _, engine, x1, _ = setup()
    for bad in (-1, 1.5, "2"):
        with pytest.raises((TypeError, ValueError), match="window"):
            engine.feature_set(x1, keep=3, window=bad)
