"""The engine against brute-force autograd Jacobians, for every strategy."""

import pytest
import torch
from torch import nn

from ntkgp.ntk import NTKEngine, resolve_groups
from tests.helpers import assert_unchanged, brute_jacobian, column_groups, float32_gram_tolerance, mlp, rel_err, small_cnn, snapshot

STRATEGIES = ["auto", "contraction", "structured"]


def frozen_mlp():
    net = mlp(d_in=3, width=6, d_out=2)
    net[2].weight.requires_grad_(False)  # a frozen weight; its bias stays trainable
    return net


CASES = {
    "mlp_c1": (lambda: mlp(d_out=1), lambda n: torch.randn(n, 3, dtype=torch.float64)),
    "mlp_c3": (lambda: mlp(d_out=3), lambda n: torch.randn(n, 3, dtype=torch.float64)),
    "cnn_bn": (lambda: small_cnn(c_out=2), lambda n: torch.randn(n, 1, 6, 6, dtype=torch.float64)),
    "frozen": (frozen_mlp, lambda n: torch.randn(n, 3, dtype=torch.float64)),
}


def reference_group_grams(net, x1, x2, groups):
    pg = resolve_groups(net, groups)
    labels = {n: g for n, g in zip(pg.names, pg.group_of)}
    j1, _ = brute_jacobian(net, x1)
    j2, _ = brute_jacobian(net, x2)
    cols = column_groups(net, labels)
    return torch.stack([j1[:, cols == g] @ j2[:, cols == g].T for g in range(pg.num_groups)])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("groups", ["layer", "network", "parameter"])
def test_group_grams_match_brute_force(case, strategy, groups):
    make_net, make_x = CASES[case]
    net = make_net()
    torch.manual_seed(1)
    x1, x2 = make_x(9), make_x(5)
    engine = NTKEngine(net, prior_structure=groups, strategy=strategy, chunk_size=4)
    before = snapshot(net)
    sym = engine.group_grams(x1)
    cross = engine.group_grams(x1, x2)
    assert_unchanged(net, before)
    assert rel_err(sym, reference_group_grams(net, x1, x1, groups)) < 1e-10
    assert rel_err(cross, reference_group_grams(net, x1, x2, groups)) < 1e-10
    c = engine.num_outputs()
    assert cross.shape == (engine.num_groups, 9 * c, 5 * c)
    assert torch.allclose(sym, sym.mT, atol=1e-12)


def test_structured_route_is_taken_for_linear_and_conv_layers():
    engine = NTKEngine(mlp(d_out=3), strategy="auto")
    plan = engine.plan(torch.randn(2, 3, dtype=torch.float64))
    assert plan.generic == () and len(plan.layers) == 3 and plan.multi == ()
    cnn = NTKEngine(small_cnn(), strategy="auto")
    plan = cnn.plan(torch.randn(2, 1, 6, 6, dtype=torch.float64))
    assert plan.names == ("conv", "head") and [la.name for la in plan.multi] == ["conv"]
    assert plan.generic == () and [la.name for la in plan.elementwise] == ["bn"]  # BatchNorm: from the features


def test_shared_linear_falls_back_to_contraction():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    torch.manual_seed(0)
    net = Tied().double()
    x = torch.randn(6, 3, dtype=torch.float64)
    engine = NTKEngine(net, strategy="auto", chunk_size=4)
    assert engine.plan(x).generic == ("fc.weight", "fc.bias")
    assert rel_err(engine.group_grams(x), reference_group_grams(net, x, x, "layer")) < 1e-10
    with pytest.raises(ValueError, match="structured"):
        NTKEngine(net, strategy="structured").group_grams(x)


def test_explicit_group_mapping():
    net = mlp(d_out=2)
    mapping = {n: ("first" if n.startswith("0.") else "rest") for n, _ in net.named_parameters()}
    x = torch.randn(7, 3, dtype=torch.float64)
    engine = NTKEngine(net, prior_structure=mapping)
    assert engine.groups.group_names == ("first", "rest")
    assert rel_err(engine.group_grams(x), reference_group_grams(net, x, x, mapping)) < 1e-10
    with pytest.raises(ValueError, match="prior_structure mapping"):
        NTKEngine(net, prior_structure={"0.weight": "a"})


@pytest.mark.parametrize("case", list(CASES))
def test_diag_blocks_and_jacobian(case):
    make_net, make_x = CASES[case]
    net = make_net()
    x = make_x(7)
    engine = NTKEngine(net, chunk_size=3)
    grams = engine.group_grams(x)
    blocks = engine.diag_blocks(x)
    c = engine.num_outputs()
    for n in range(7):
        assert torch.allclose(blocks[:, n], grams[:, n * c : (n + 1) * c, n * c : (n + 1) * c], rtol=1e-10, atol=1e-12)
    j_ref, _ = brute_jacobian(net, x)
    assert rel_err(engine.jacobian(x), j_ref) < 1e-12


@pytest.mark.parametrize("case", ["mlp_c3", "cnn_bn"])
def test_matrix_free_products_equal_gram_products(case):
    make_net, make_x = CASES[case]
    net = make_net()
    x = make_x(8)
    engine = NTKEngine(net, chunk_size=3)
    weights = torch.rand(engine.num_groups, dtype=torch.float64) + 0.5
    gram = torch.einsum("g,gij->ij", weights, engine.group_grams(x))
    v = torch.randn(gram.shape[0], 4, dtype=torch.float64)
    before = snapshot(net)
    assert rel_err(engine.matvec(x, v, weights), gram @ v) < 1e-10
    assert rel_err(engine.matvec(x, v[:, 0], weights), gram @ v[:, 0]) < 1e-10
    assert_unchanged(net, before)


def test_recompute_when_jacobian_does_not_fit():
    net = mlp(d_out=2)
    x1, x2 = torch.randn(9, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    small = NTKEngine(net, strategy="contraction", chunk_size=2, max_jacobian_bytes=0)
    big = NTKEngine(net, strategy="contraction", chunk_size=2)
    assert rel_err(small.group_grams(x1, x2), big.group_grams(x1, x2)) < 1e-13
    assert rel_err(small.group_grams(x1), big.group_grams(x1)) < 1e-13


def test_float32_agrees_with_float64():
    net64 = mlp(d_out=3)
    net32 = mlp(d_out=3, dtype=torch.float32)
    x = torch.randn(20, 3, dtype=torch.float64)
    k64 = NTKEngine(net64).group_grams(x)
    k32 = NTKEngine(net32).group_grams(x.float())
    assert k32.dtype == torch.float32
    assert (k32.double() - k64).norm() <= float32_gram_tolerance(net64, k64.diagonal(dim1=-2, dim2=-1))


def test_bad_inputs_raise_clear_errors():
    net = mlp()
    engine = NTKEngine(net)
    bad = torch.randn(4, 3, dtype=torch.float64)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="x1 contains NaN"):
        engine.group_grams(bad)
    with pytest.raises(ValueError, match="x1 of shape .* does not fit the network"):
        engine.group_grams(torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="input_shape|shape"):
        NTKEngine(small_cnn(), input_shape=(1, 6, 6)).group_grams(torch.randn(3, 35, dtype=torch.float64))
    with pytest.raises(TypeError, match="net must be"):
        NTKEngine(lambda x: x)


def test_non_matrix_output_is_rejected():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x):
            return self.fc(x).squeeze(-1)

    with pytest.raises(ValueError, match=r"outputs of shape \(\d+, C\)"):
        NTKEngine(Flat().double()).group_grams(torch.randn(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("module", [nn.BatchNorm1d(7), nn.Dropout(0.2)])
def test_training_mode_batchnorm_or_dropout_is_rejected(module):
    net = nn.Sequential(nn.Linear(3, 7), module, nn.Tanh(), nn.Linear(7, 1)).double()
    net.train()
    with pytest.raises(ValueError, match="training mode"):
        NTKEngine(net)
    net.eval()
    engine = NTKEngine(net)
    net.train()  # switched back after construction: caught at call time
    with pytest.raises(ValueError, match="training mode"):
        engine.group_grams(torch.randn(3, 3, dtype=torch.float64))
    assert net.training


def test_images_through_input_shape():
    net = small_cnn()
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    flat = NTKEngine(net, input_shape=(1, 6, 6)).group_grams(x.flatten(1))
    assert rel_err(flat, NTKEngine(net).group_grams(x)) < 1e-14


def test_inputs_are_not_modified():
    net = mlp(d_out=2, dtype=torch.float32)
    x = torch.randn(6, 3, dtype=torch.float64)
    x_copy = x.clone()
    NTKEngine(net).group_grams(x)
    assert x.dtype == torch.float64 and torch.equal(x, x_copy)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    net = mlp(d_out=3)
    x = torch.randn(10, 3, dtype=torch.float64)
    cpu = NTKEngine(net).group_grams(x)
    gpu = NTKEngine(mlp(d_out=3).cuda()).group_grams(x.cuda())
    assert gpu.is_cuda and rel_err(gpu.cpu(), cpu) < 1e-10


@pytest.mark.parametrize("case", ["mlp_c1", "mlp_c3", "cnn_bn", "frozen"])
@pytest.mark.parametrize("groups", ["layer", "network", "parameter"])
def test_output_grams_are_the_diagonal_output_blocks_of_group_grams(case, groups):
    make_net, make_x = CASES[case]
    net = make_net()
    torch.manual_seed(2)
    x1, x2 = make_x(7), make_x(4)
    engine = NTKEngine(net, prior_structure=groups, chunk_size=3)
    before = snapshot(net)
    c = engine.num_outputs(x1)
    g = engine.num_groups
    for a, b in ((x1, x2), (x1, None)):
        full = engine.group_grams(a, b)
        m = a.shape[0] if b is None else b.shape[0]
        ref = torch.stack([full.view(g, a.shape[0], c, m, c)[:, :, k, :, k] for k in range(c)], 1)
        grams = engine.output_grams(a, b)
        assert grams.shape == (g, c, a.shape[0], m)
        assert rel_err(grams, ref) < 1e-12
        grams2, diag = engine.output_grams(a, b, with_diagonal=True)
        assert torch.equal(grams2, grams)
        ref_diag = engine.diag_blocks(a if b is None else b).diagonal(dim1=-2, dim2=-1)
        assert diag.shape == (g, m, c)
        assert rel_err(diag, ref_diag) < 1e-12
    assert_unchanged(net, before)
    plan = engine.plan(x1)
    assert not plan.generic and bool(plan.elementwise) == (case == "cnn_bn")  # BatchNorm's rows from the features


def test_group_sq_norms():
    net = frozen_mlp()
    norms = NTKEngine(net, prior_structure="layer").group_sq_norms()
    expected = torch.stack([net[0].weight.square().sum() + net[0].bias.square().sum(),
                            net[2].bias.square().sum(),  # net[2].weight is frozen: not in the prior
                            net[4].weight.square().sum() + net[4].bias.square().sum()]).detach()
    assert torch.allclose(norms, expected, rtol=1e-14)
