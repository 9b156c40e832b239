"""Structured chunked passes for CNNs (the FSVI paper's FMNIST architecture, scaled down): Grams, per-output
Grams, diagonals and per-point blocks against brute-force autograd Jacobians in float64, over several chunks, with
the contracted columns kept and recomputed, one backward pass per output and one batched backward; the layer
check runs once per input shape, never per chunk, and no vmap(jacrev) Jacobian is formed."""

from unittest import mock

import pytest
import torch
from torch import nn

from ntkgp.ntk import NTKEngine, features, layer_plan, resolve_groups
from tests.helpers import assert_unchanged, brute_jacobian, column_groups, float32_gram_tolerance, rel_err, snapshot


def small_fmnist_cnn(batchnorm: bool = False) -> nn.Module:
    """conv 'same' → ReLU → max-pool → conv (padding 1) → [BatchNorm] → ReLU → max-pool → FC → tanh → FC (tanh: no
    unit of the small hidden layer is dead for every input)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding="same"), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, padding=1), *([nn.BatchNorm2d(4)] if batchnorm else []), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * 2 * 2, 5), nn.Tanh(), nn.Linear(5, 3),
    ).double()
    if batchnorm:
        net.train()
        with torch.no_grad():
            for _ in range(3):
                net(torch.randn(16, 1, 8, 8, dtype=torch.float64))
    return net.eval()


def reference(net, x1, x2, prior_structure="layer"):
    """Per-group Grams from dense autograd Jacobians (row by row)."""
    pg = resolve_groups(net, prior_structure)
    cols = column_groups(net, dict(zip(pg.names, pg.group_of)))
    j1, _ = brute_jacobian(net, x1)
    j2, _ = brute_jacobian(net, x2)
    return torch.stack([j1[:, cols == g] @ j2[:, cols == g].T for g in range(pg.num_groups)])


def per_output(full, g, n1, n2, c):
    return full.view(g, n1, c, n2, c).diagonal(dim1=2, dim2=4).permute(0, 3, 1, 2)


@pytest.mark.parametrize("batched", [False, True], ids=["one_backward_per_output", "batched_backward"])
@pytest.mark.parametrize("keep", [True, False], ids=["columns_kept", "columns_recomputed"])
@pytest.mark.parametrize("batchnorm", [False, True], ids=["plain", "batchnorm"])
def test_cnn_grams_and_diagonals_match_dense_jacobians(batched, keep, batchnorm, monkeypatch):
    monkeypatch.setattr(features, "BATCHED_BACKWARD", batched)
    net = small_fmnist_cnn(batchnorm)
    torch.manual_seed(1)
    x1, x2 = torch.randn(7, 1, 8, 8, dtype=torch.float64), torch.randn(5, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net, prior_structure="parameter", chunk_size=3, max_jacobian_bytes=2**30 if keep else 0)
    plan = engine.plan(x1)
    assert [la.name for la in plan.multi] == ["0", "3"] and [la.name for la in plan.single] == list(plan.names[2:])
    assert plan.generic == ()  # BatchNorm: the elementwise route (its rows from the same features), no vmap(jacrev)
    assert [la.name for la in plan.elementwise] == (["4"] if batchnorm else [])
    before = snapshot(net)
    g, c = engine.num_groups, 3
    cross, sym = reference(net, x1, x2, "parameter"), reference(net, x1, x1, "parameter")
    assert rel_err(engine.group_grams(x1, x2), cross) < 1e-10
    assert rel_err(engine.group_grams(x1), sym) < 1e-10
    grams, diag = engine.output_grams(x1, x2, with_diagonal=True)
    assert rel_err(grams, per_output(cross, g, 7, 5, c)) < 1e-10
    blocks = torch.stack([reference(net, x2[i : i + 1], x2[i : i + 1], "parameter") for i in range(5)], 1)
    assert rel_err(diag, blocks.diagonal(dim1=-2, dim2=-1)) < 1e-10
    assert rel_err(engine.output_grams(x1), per_output(sym, g, 7, 7, c)) < 1e-10
    assert rel_err(engine.diag_blocks(x2), blocks) < 1e-10
    assert_unchanged(net, before)


def test_no_vmap_jacobian_and_one_check_per_input_shape():
    """The convolutions and linear layers come from their features (no per-example vmap(jacrev) Jacobian), and
    the layer check against autograd runs once per input shape, whatever the number of calls and chunks."""
    net = small_fmnist_cnn()
    x1, x2 = torch.randn(9, 1, 8, 8, dtype=torch.float64), torch.randn(4, 1, 8, 8, dtype=torch.float64)
    engine = NTKEngine(net, chunk_size=2)

    def no_jacobian(*args, **kwargs):
        raise AssertionError("vmap(jacrev) Jacobian formed")

    engine.core.jacobian_chunk = no_jacobian
    checks = mock.patch.object(layer_plan, "verify_layers", wraps=layer_plan.verify_layers)
    with checks as verify:
        engine.output_grams(x1, x2, with_diagonal=True)
        engine.group_grams(x1, x2)
        engine.diag_blocks(x1)
        engine.output_grams(x2)
        engine.output_grams(torch.randn(5, 64, dtype=torch.float64).view(5, 1, 8, 8))
        assert verify.call_count == 1
    assert rel_err(engine.group_grams(x1, x2), reference(net, x1, x2)) < 1e-10


def test_batched_backward_keeps_input_gradients():
    """With a graph to the inputs (second-order autograd through the features), the batched backward gives the
    gradients of the one-pass-per-output route, which the input-gradient tests check by finite differences."""
    net = small_fmnist_cnn(batchnorm=True)
    x0 = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    z = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    weights = torch.randn(3, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = []
    for batched in (False, True):
        with mock.patch.object(features, "BATCHED_BACKWARD", batched):
            x = x0.clone().requires_grad_(True)
            value = (NTKEngine(net).output_grams(z, x).sum(0) * weights).sum()
            grads.append(torch.autograd.grad(value, x)[0])
    assert rel_err(grads[1], grads[0]) < 1e-10 and grads[0].abs().max() > 0


def test_float32_cnn_agrees_with_float64():
    net64 = small_fmnist_cnn()
    net32 = small_fmnist_cnn().float()
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    k64, d64 = NTKEngine(net64).output_grams(x, x[:3], with_diagonal=True)
    k32, d32 = NTKEngine(net32).output_grams(x.float(), x[:3].float(), with_diagonal=True)
    # ε·r·√(tr_x tr_z) per group and output (tests.helpers.float32_gram_tolerance), the diagonals from float64
    full = NTKEngine(net64).output_grams(x).diagonal(dim1=-2, dim2=-1)  # (G, C, 6): K(x_i, x_i)
    assert k32.dtype == torch.float32
    assert (k32.double() - k64).norm() <= float32_gram_tolerance(net64, full, full[..., :3])
    assert (d32.double() - d64).norm() <= float32_gram_tolerance(net64, d64.flatten(-2), d64.flatten(-2))
