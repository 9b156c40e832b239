"""A float32 network's Grams against float64 given features (SFR's cross-Grams ``K_Zx``: ``x2``'s float32 features
promoted into one buffer reused from chunk to chunk, the columns joined in float64 for the full Grams) against dense
float64 autograd Jacobians; and the squared row norms of the output diagonals (:func:`~ntkgp.ntk.contraction
.squared_norms`, no squares formed) against exact sums."""

import math

import pytest
import torch

from ntkgp.ntk import NTKEngine, resolve_groups
from ntkgp.ntk.contraction import NORM_SEGMENT, squared_norms
from tests.helpers import brute_jacobian, column_groups, float32_gram_tolerance
from tests.ntk.test_cnn_passes import small_fmnist_cnn
from tests.ntk.test_given_features import dense_output_grams


def test_float32_grams_against_float64_given_features_equal_brute_force():
    """Chunks of 4 points over 9 (the last one smaller: the buffer reused, never grown), a BatchNorm (generic
    columns) and each parameter its own group (weight and bias apart: a strided bias piece)."""
    net64 = small_fmnist_cnn(batchnorm=True)
    net32 = small_fmnist_cnn(batchnorm=True).float()
    torch.manual_seed(3)
    z, x = torch.randn(7, 1, 8, 8, dtype=torch.float64), torch.randn(9, 1, 8, 8).double()
    exact = NTKEngine(net64, "parameter", chunk_size=4).feature_set(z)
    engine32 = NTKEngine(net32, "parameter", chunk_size=4)
    full, blocks = engine32.group_grams(z.float(), x.float(), x1_features=exact, with_blocks=True)
    grams, diag = engine32.output_grams(z.float(), x.float(), with_diagonal=True, x1_features=exact)
    assert full.dtype == blocks.dtype == grams.dtype == diag.dtype == torch.float64
    (jz, _), (jx, _) = brute_jacobian(net64, z), brute_jacobian(net64, x)  # float64, row by row
    pg = resolve_groups(net64, "parameter")
    cols = column_groups(net64, dict(zip(pg.names, pg.group_of)))
    ref = torch.stack([jz[:, cols == g] @ jx[:, cols == g].T for g in range(pg.num_groups)])  # (G, 7·3, 9·3)
    rows_x = jx.view(9, 3, -1)
    ref_blocks = torch.stack([rows_x[..., cols == g] @ rows_x[..., cols == g].transpose(1, 2)
                              for g in range(pg.num_groups)])  # (G, 9, 3, 3)
    diag_x = ref_blocks.diagonal(dim1=-2, dim2=-1)  # (G, N, C), as output_grams gives it
    diag_z = torch.stack([jz[:, cols == g].square().sum(-1).view(7, 3).T for g in range(pg.num_groups)])
    # only x's features are float32 (z's float64, the products float64): within the float32 Gram model's
    # r·ε·√(tr_z tr_x) (tests.helpers.float32_gram_tolerance), which a wrongly reused buffer (another chunk's
    # features) exceeds by orders of magnitude; 1 % of the Gram fails it
    tol = float32_gram_tolerance(net64, diag_z, diag_x.transpose(1, 2))
    assert tol < 1e-2 * ref.norm()
    assert (full - ref).norm() <= tol
    assert (grams - dense_output_grams(ref, 3)).norm() <= tol
    tol_xx = float32_gram_tolerance(net64, diag_x.transpose(1, 2))  # the per-point blocks: x against itself
    assert (blocks - ref_blocks).norm() <= tol_xx and (diag - diag_x).norm() <= tol_xx


@pytest.mark.parametrize("width", [1, NORM_SEGMENT - 1, NORM_SEGMENT, 3 * NORM_SEGMENT, 5 * NORM_SEGMENT + 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_squared_norms_equal_exact_sums(width, dtype):
    """Float32 numbers of spread magnitudes: their squares are exact in float64, so ``math.fsum`` gives the correctly
    rounded sum. Error model: the segments' norms and the pairwise sum of their squares round ``log2(width) + 4``
    times at most (a rounding per level of the sums, the square root and the square), the measured error a few
    units; a strided (non-contiguous) view gives the same."""
    generator = torch.Generator().manual_seed(width)
    rows = (torch.randn(6, 2 * width, generator=generator) * torch.rand(6, 2 * width, generator=generator).pow(4)
            * 1e3).float()
    view = rows[:, ::2].to(dtype)  # every other number: strided
    exact = torch.tensor([math.fsum(v * v for v in r.tolist()) for r in view.double()], dtype=torch.float64)
    got = squared_norms(view)
    assert got.dtype == dtype and got.shape == (6,)
    bound = (math.log2(width) + 4) * torch.finfo(dtype).eps
    assert ((got.double() - exact).abs() <= bound * exact).all()
    assert torch.equal(squared_norms(view.contiguous()), got) or \
        ((squared_norms(view.contiguous()).double() - exact).abs() <= bound * exact).all()
