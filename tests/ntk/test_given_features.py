"""Grams against given layer features of the first argument (``NTKEngine.feature_set``, ``x1_features``): the inducing
inputs' features computed once and reused (issue 27). Checked against dense autograd Jacobians in float64 on a small
CNN over several chunks, with one pass over ``x2`` per call; the per-chunk memory formula against the tensors a
chunk's pass actually holds; and the refusals."""

from unittest import mock

import pytest
import torch
from torch import nn

from ntkgp.ntk import NTKEngine, feature_pass
from ntkgp.ntk.feature_pass import chunk_bytes, chunk_features, chunk_for_budget
from tests.helpers import float32_gram_tolerance, rel_err
from tests.ntk.test_cnn_passes import reference, small_fmnist_cnn


def dense_output_grams(full: torch.Tensor, c: int) -> torch.Tensor:
    """``(G, C, N1, N2)`` from full Grams ``(G, N1·C, N2·C)``."""
    g, r1, r2 = full.shape
    blocks = full.view(g, r1 // c, c, r2 // c, c)
    return torch.stack([blocks[:, :, k, :, k] for k in range(c)], dim=1)


@pytest.mark.parametrize("prior_structure", ["layer", "network"])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_grams_from_given_features_equal_brute_force(prior_structure, batchnorm):
    net = small_fmnist_cnn(batchnorm)  # BatchNorm: a generic parameter (vmap(jacrev) columns) among the layers
    torch.manual_seed(1)
    z, x = torch.randn(7, 1, 8, 8, dtype=torch.float64), torch.randn(9, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net, prior_structure, chunk_size=4)  # several chunks on both sides
    fz = engine.feature_set(z)
    ref, ref_zz = reference(net, z, x, prior_structure), reference(net, z, z, prior_structure)
    blocks_ref = reference(net, x, x, prior_structure).view(-1, 9, 3, 9, 3).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
    full, blocks = engine.group_grams(z, x, x1_features=fz, with_blocks=True)
    assert rel_err(full, ref) < 1e-12 and rel_err(blocks, blocks_ref) < 1e-12
    assert rel_err(engine.group_grams(z, x, x1_features=fz), ref) < 1e-12
    per_output, diag = engine.output_grams(z, x, with_diagonal=True, x1_features=fz)
    assert rel_err(per_output, dense_output_grams(ref, 3)) < 1e-12
    assert rel_err(diag, blocks_ref.diagonal(dim1=-2, dim2=-1)) < 1e-12
    assert rel_err(engine.group_grams(z, x1_features=fz), ref_zz) < 1e-12  # symmetric: Z with itself
    assert rel_err(engine.output_grams(z, x1_features=fz), dense_output_grams(ref_zz, 3)) < 1e-12


@pytest.mark.parametrize("prior_structure", ["parameter", "network"])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_outputs_and_linearized_offsets_from_the_same_pass_equal_autograd(prior_structure, batchnorm):
    """``with_outputs``: f(x) and J(x)θ* from the feature pass (convolution blocks against Θ, linear layers, generic
    BatchNorm parameters; weight and bias in one group or two) against the network and a dense autograd Jacobian."""
    net = small_fmnist_cnn(batchnorm)
    torch.manual_seed(2)
    z, x = torch.randn(5, 1, 8, 8, dtype=torch.float64), torch.randn(9, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net, prior_structure, chunk_size=4)
    fz = engine.feature_set(z)
    grams, diag, f, linearized = engine.output_grams(z, x, with_diagonal=True, x1_features=fz, with_outputs=True)
    names = [n for n, _ in net.named_parameters()]
    theta = {n: p.detach() for n, p in net.named_parameters()}
    jac = torch.func.jacrev(lambda t: torch.func.functional_call(net, t, (x,)))(theta)
    dense = sum(torch.einsum("nc...,...->nc", jac[n], theta[n]) for n in names)
    assert rel_err(f, net(x).detach()) < 1e-13
    assert rel_err(linearized, dense) < 1e-12
    ref = reference(net, z, x, prior_structure)
    assert rel_err(grams, dense_output_grams(ref, 3)) < 1e-12 and diag.shape == (engine.num_groups, 9, 3)
    full, blocks, f2, linearized2 = engine.group_grams(z, x, x1_features=fz, with_blocks=True, with_outputs=True)
    assert rel_err(full, ref) < 1e-12 and blocks.shape == (engine.num_groups, 9, 3, 3)
    assert rel_err(f2, net(x).detach()) < 1e-13 and rel_err(linearized2, dense) < 1e-12


def test_given_features_pass_each_chunk_of_x2_once_and_never_recompute_x1():
    net = small_fmnist_cnn()
    z, x = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.randn(10, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net, chunk_size=4)
    fz = engine.feature_set(z)
    sizes = []
    real = feature_pass.chunk_features

    def spy(core, plan, xc, *args, **kwargs):
        sizes.append(xc.shape[0])
        return real(core, plan, xc, *args, **kwargs)

    with mock.patch("ntkgp.ntk.grams.chunk_features", spy), mock.patch("ntkgp.ntk.feature_pass.chunk_features", spy):
        engine.output_grams(z, x, with_diagonal=True, x1_features=fz)
        engine.group_grams(z, x, x1_features=fz, with_blocks=True)
    assert sizes == [4, 4, 2, 4, 4, 2]  # x2's three chunks per call; nothing of z


def test_features_converted_to_float32_give_the_float32_grams():
    net64 = small_fmnist_cnn()
    net32 = small_fmnist_cnn().float()
    z, x = torch.randn(5, 1, 8, 8, dtype=torch.float64), torch.randn(6, 1, 8, 8, dtype=torch.float64)
    exact = NTKEngine(net64).feature_set(z)
    engine32 = NTKEngine(net32)
    got = engine32.output_grams(z.float(), x.float(), x1_features=exact.converted(torch.float32))
    assert got.dtype == torch.float32
    # ε·r·√(tr_z tr_x) per group and output (tests.helpers.float32_gram_tolerance), the diagonals from float64
    # references; the given float64 features of z rounded once to float32 are within that model
    diagonal_z = dense_output_grams(reference(net64, z, z), 3).diagonal(dim1=-2, dim2=-1)
    diagonal_x = dense_output_grams(reference(net64, x, x), 3).diagonal(dim1=-2, dim2=-1)
    expected = dense_output_grams(reference(net64, z, x), 3)
    tolerance = float32_gram_tolerance(net64, diagonal_z, diagonal_x)
    assert tolerance < 1e-2 * expected.norm()  # a meaningful bound: a 1 % error fails
    assert (got.double() - expected).norm() <= tolerance


def test_given_features_are_checked():
    net = small_fmnist_cnn()
    z = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net)
    fz = engine.feature_set(z)
    with pytest.raises(ValueError, match="x1_features are not those of x1"):
        engine.output_grams(z[:4], z, x1_features=fz)
    with pytest.raises(TypeError, match="x1_features must be a FeatureSet"):
        engine.output_grams(z, z, x1_features=z)
    with pytest.raises(ValueError, match="with_blocks=True needs x1_features and x2"):
        engine.group_grams(z, z, with_blocks=True)
    with pytest.raises(ValueError, match="with_outputs=True needs x1_features and x2"):
        engine.output_grams(z, z, with_outputs=True)
    with pytest.raises(ValueError, match="with_outputs=True needs x1_features and x2"):
        engine.output_grams(z, x1_features=fz, with_outputs=True)
    with pytest.raises(ValueError, match="with_outputs=True needs x1_features and x2"):
        engine.group_grams(z, z, with_outputs=True)
    with pytest.raises(ValueError, match="require grad"):
        engine.output_grams(z, z.clone().requires_grad_(True), x1_features=fz)


def test_chunk_bytes_bounds_what_a_chunk_holds():
    """The columns and unfolded inputs a chunk's pass holds are within the stated per-example bytes; the chunk for a
    budget is the largest that fits it."""
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)).double()
    engine = NTKEngine(net)
    x = torch.randn(8, 1, 6, 6, dtype=torch.float64)
    plan = engine.plan(x)
    per_example = chunk_bytes(engine.core, plan, 3, 8)
    held = chunk_features(engine.core, plan, x, False)
    columns = sum(t.numel() for t in held.columns.values()) * 8
    assert columns == 8 * 3 * (4 * 10) * 8  # n·C·P_c numbers: the conv's weight and bias columns
    assert 2 * columns + 8 * 10 * 36 * 8 <= 8 * per_example  # twice the columns (joined from the pieces) and the patches
    budget = 5 * per_example + 1
    assert chunk_for_budget(engine.core, plan, 3, 8, budget=budget) == 5
    assert chunk_for_budget(engine.core, plan, 3, 8, budget=1) == 1
    assert chunk_for_budget(engine.core, plan, 3, 8, budget=2**40, largest=64) == 64


def test_grams_from_features_kept_in_part_equal_brute_force():
    """``feature_set(z, keep=k)``: the columns of the chunks within the first ``k`` points kept, the others recomputed
    at each use; every Gram equals the dense reference; a float64 set converted to float32 with ``release`` rounds
    the recomputed chunks as the kept ones (the same numbers) and leaves the source recomputing what it gave away."""
    net = small_fmnist_cnn()
    torch.manual_seed(3)
    z, x = torch.randn(7, 1, 8, 8, dtype=torch.float64), torch.randn(9, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net, "layer", chunk_size=3)
    fz = engine.feature_set(z, keep=5)  # chunks 0:3 kept, 3:6 and 6:7 recomputed
    assert [cols is not None for cols in fz.kept] == [True, False, False] and fz.kept_points == 3 and not fz.keep
    assert fz.held_points == 3 and fz.kept[0][0].data_ptr() == fz.held[0].data_ptr()  # the kept chunk: a view
    ref, ref_zz = reference(net, z, x, "layer"), reference(net, z, z, "layer")
    assert rel_err(engine.group_grams(z, x, x1_features=fz), ref) < 1e-12
    assert rel_err(engine.output_grams(z, x, x1_features=fz), dense_output_grams(ref, 3)) < 1e-12
    assert rel_err(engine.group_grams(z, x1_features=fz), ref_zz) < 1e-12
    full = engine.feature_set(z)
    rounded = full.converted(torch.float32)
    partial = fz.converted(torch.float32, release=True)
    assert fz.kept_points == 0 and partial.kept_points == 3 and fz.held is None and partial.held_points == 3
    for k in range(3):
        for g, cols in rounded.columns(k).items():
            assert cols.dtype == torch.float32 and torch.equal(partial.columns(k)[g], cols)
            assert torch.equal(fz.columns(k)[g], full.columns(k)[g])


@pytest.mark.parametrize("structure, batchnorm", [("network", False), ("layer", False), ("network", True)])
def test_held_columns_written_in_place_equal_brute_force(structure, batchnorm):
    """A set of several chunks holds its columns in one tensor per group (the convolutions' blocks of every chunk after
    the first written into it in place, both convolutions in one group with ``"network"``): its Grams, alone and
    against other inputs, equal the dense reference (with a BatchNorm layer's rows among the columns)."""
    net = small_fmnist_cnn(batchnorm).eval()
    torch.manual_seed(4)
    z, x = torch.randn(7, 1, 8, 8, dtype=torch.float64), torch.randn(5, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net, structure, chunk_size=3)
    fz = engine.feature_set(z)
    assert fz.held_points == 7 and all(cols[g].data_ptr() >= fz.held[g].data_ptr() for cols in fz.kept for g in cols)
    ref, ref_zz = reference(net, z, x, structure), reference(net, z, z, structure)
    assert rel_err(engine.group_grams(z, x, x1_features=fz), ref) < 1e-12
    assert rel_err(engine.output_grams(z, x, x1_features=fz), dense_output_grams(ref, 3)) < 1e-12
    assert rel_err(engine.group_grams(z, x1_features=fz), ref_zz) < 1e-12
    assert rel_err(engine.group_grams(x, z), ref.mT) < 1e-12  # x2 = z's features computed and held by the engine
