"""The NTK's elementwise routes (ntkgp.ntk.elementwise_pass, ntkgp.ntk.token_grams): the affine parameters of
BatchNorm / GroupNorm / LayerNorm / InstanceNorm / RMSNorm from the pass's own features and nn.Embedding by a Gram of equal tokens, against
dense autograd Jacobians (row by row, tests/helpers.py) in float64 and a float64 copy in float32; with one prior
group, one per layer and one per parameter tensor (weight and bias of a norm apart), weighted by per-group prior
precisions; an embedding used twice in one forward pass (weight sharing); no vmap(jacrev) for these parameters and
never a dense per-example row of the table."""

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from ntkgp.kernels import NTKKernel
from ntkgp.ntk import NTKEngine, token_grams
from ntkgp.ntk.feature_pass import chunk_bytes, chunk_features, contracted_width
from ntkgp.ntk.groups import resolve_groups
from ntkgp.ntk.norm_features import EmbeddingLayer
from tests.helpers import (
    assert_unchanged,
    brute_gram,
    brute_jacobian,
    column_groups,
    float32_gram_tolerance,
    rel_err,
    snapshot,
)

F64 = torch.float64


def _randomize(net: nn.Module) -> nn.Module:
    """Running statistics and affine parameters away from their defaults (1, 0), eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d, nn.RMSNorm)):
                m.weight.normal_()
                if getattr(m, "bias", None) is not None:
                    m.bias.normal_()
    return net.eval()


class SequenceMLP(nn.Module):
    """Linear on sequences → LayerNorm → tanh → Linear → mean over the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ln, self.out = nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.ln(self.inp(x)))).mean(dim=1)


class TokenHead(nn.Module):
    """Embedding (a padding token) → mean over the positions → tanh → Linear; ``twice``: the same table also embeds
    the sequence reversed and shortened (weight sharing: one module called twice per forward pass)."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.embed, self.head, self.twice = nn.Embedding(11, 4, padding_idx=0), nn.Linear(4, 3), twice

    def forward(self, ids):
        h = self.embed(ids).mean(dim=1)
        if self.twice:
            h = h * self.embed(ids.flip(1)[:, :3]).sum(dim=1)
        return self.head(torch.tanh(h))


def token_ids(n: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 11, (n, 5), generator=torch.Generator().manual_seed(seed))
    ids[0, :3] = 4  # a token repeated within one example
    ids[-1, 0] = 0  # a padding token
    return ids


def floats(*shape):
    def make(n: int, seed: int) -> torch.Tensor:
        return torch.randn(n, *shape, dtype=F64, generator=torch.Generator().manual_seed(seed))

    return make


NETWORKS = {
    "mlp_batchnorm1d": (lambda: nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)),
                        floats(3), ["1"]),
    "cnn_batchnorm2d_groupnorm": (lambda: nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.GroupNorm(2, 4),
        nn.Tanh(), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)), floats(1, 5, 5), ["1", "4"]),
    "layernorm_sequences": (SequenceMLP, floats(6, 3), ["ln"]),
    "instancenorm_rmsnorm": (lambda: nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.InstanceNorm2d(3, affine=True), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4),
        nn.RMSNorm(4), nn.Linear(4, 2)), floats(1, 5, 5), ["1", "5"]),
    "embedding_mean_pool": (TokenHead, token_ids, ["embed"]),
    "embedding_used_twice": (lambda: TokenHead(twice=True), token_ids, ["embed"]),
}


def build(case: str, dtype=F64):
    make_net, make_x, elementwise = NETWORKS[case]
    torch.manual_seed(0)
    return _randomize(make_net().to(dtype)), make_x, elementwise


def reference(net, x1, x2, structure):
    """Per-group Grams ``(G, N1·C, N2·C)``, per-point blocks of ``x2`` ``(G, N2, C, C)`` and Grams of ``x2`` with
    itself from dense autograd Jacobians, and the Jacobian of ``x2``."""
    groups = resolve_groups(net, structure)
    cols = column_groups(net, dict(zip(groups.names, groups.group_of)))
    j1, _ = brute_jacobian(net, x1)
    j2, _ = brute_jacobian(net, x2)
    n2 = x2.shape[0]
    per_point = j2.view(n2, -1, j2.shape[-1])
    grams = torch.stack([j1[:, cols == g] @ j2[:, cols == g].T for g in range(groups.num_groups)])
    blocks = torch.stack([per_point[..., cols == g] @ per_point[..., cols == g].transpose(1, 2)
                          for g in range(groups.num_groups)])
    sym = torch.stack([j2[:, cols == g] @ j2[:, cols == g].T for g in range(groups.num_groups)])
    return grams, blocks, j2, sym


def no_generic_jacobian(*args, **kwargs):
    raise AssertionError("a vmap(jacrev) Jacobian was formed")


@pytest.mark.parametrize("structure", ["network", "parameter"])
@pytest.mark.parametrize("case", list(NETWORKS))
def test_grams_diagonals_and_outputs_match_dense_jacobians(case, structure):
    net, make_x, elementwise = build(case)
    x1, x2 = make_x(5, 1), make_x(4, 2)
    engine = NTKEngine(net, prior_structure=structure, chunk_size=2, max_jacobian_bytes=2**20)
    plan = engine.plan(engine.prepare(x1))
    assert [la.name for la in plan.elementwise] == elementwise and plan.generic == ()
    engine.core.jacobian_chunk = no_generic_jacobian  # every parameter from the features
    before = snapshot(net)
    cross, blocks, j2, sym = reference(net, x1, x2, structure)
    g, c = cross.shape[0], j2.shape[0] // 4
    assert rel_err(engine.group_grams(x1, x2), cross) < 1e-10
    assert rel_err(engine.group_grams(x2), sym) < 1e-10
    grams, diag = engine.output_grams(x1, x2, with_diagonal=True)
    per_output = cross.view(g, 5, c, 4, c).diagonal(dim1=2, dim2=4).permute(0, 3, 1, 2)
    assert rel_err(grams, per_output) < 1e-10
    assert rel_err(diag, blocks.diagonal(dim1=-2, dim2=-1)) < 1e-10
    assert rel_err(engine.diag_blocks(x2), blocks) < 1e-10
    # given features of x1 (SFR's inducing inputs; keep=2: the first chunk kept, the others recomputed at each use),
    # with f(x2) and J(x2)θ* from the same pass
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    features = engine.feature_set(x1, keep=2)
    full, given_blocks, f, linear = engine.group_grams(x1, x2, x1_features=features, with_blocks=True,
                                                       with_outputs=True)
    assert rel_err(full, cross) < 1e-10 and rel_err(given_blocks, blocks) < 1e-10
    assert rel_err(linear, (j2 @ theta).view(4, c)) < 1e-10 and rel_err(f, net(x2).detach()) < 1e-12
    given, given_diag = engine.output_grams(x1, x2, with_diagonal=True, x1_features=features)
    assert rel_err(given, per_output) < 1e-10 and rel_err(given_diag, blocks.diagonal(dim1=-2, dim2=-1)) < 1e-10
    assert_unchanged(net, before)


@pytest.mark.parametrize("case", ["cnn_batchnorm2d_groupnorm", "embedding_used_twice"])
def test_kernel_weighted_by_per_group_prior_precisions(case):
    """NTKKernel's Σ_g J_g J_gᵀ / δ_g with one δ per parameter tensor against the dense Jacobians'."""
    net, make_x, _ = build(case)
    x1, x2 = make_x(4, 3), make_x(3, 4)
    groups = resolve_groups(net, "parameter")
    delta = torch.linspace(0.5, 3.0, groups.num_groups, dtype=F64)
    kernel = NTKKernel(net, prior_precision=delta, prior_structure="parameter", progress=False)
    labels = dict(zip(groups.names, groups.group_of))
    x1k, x2k = (x1.flatten(1), x2.flatten(1)) if x1.dim() > 2 else (x1, x2)
    if x1.dim() > 2:
        kernel = NTKKernel(net, prior_precision=delta, prior_structure="parameter", input_shape=tuple(x1.shape[1:]),
                           progress=False)
    with torch.no_grad():
        value = kernel(x1k, x2k).to_dense()
    assert rel_err(value, brute_gram(net, x1, x2, delta, labels)) < 1e-10


@pytest.mark.parametrize("case", list(NETWORKS))
def test_float32_network_agrees_with_its_float64_copy(case):
    """A float32 network's Grams against those of its float64 copy (the same weights), within the error model of
    tests/helpers.float32_gram_tolerance: each entry from features rounded by about 2Lε and summed over P products,
    |ΔK_ij| ≤ rε√(K_ii K_jj), bounded in Frobenius norm by rε√(tr₁ tr₂) from the float64 diagonals (r its growth
    factor, measured on the network)."""
    net64, make_x, _ = build(case)
    net32 = copy.deepcopy(net64).float()
    x1, x2 = make_x(5, 5), make_x(4, 6)
    as32 = (lambda x: x) if not x1.is_floating_point() else (lambda x: x.float())
    e64, e32 = NTKEngine(net64, chunk_size=3), NTKEngine(net32, chunk_size=3)
    k64, k32 = e64.group_grams(x1, x2), e32.group_grams(as32(x1), as32(x2))
    assert k32.dtype == torch.float32
    o32, diag32 = e32.output_grams(as32(x1), with_diagonal=True)
    o64, diag64 = e64.output_grams(x1, with_diagonal=True)
    d1 = diag64.flatten(1)  # the float64 Gram's diagonals, (G, N·C)
    d2 = e64.diag_blocks(x2).diagonal(dim1=-2, dim2=-1).flatten(1)
    assert (k32.double() - k64).norm() <= float32_gram_tolerance(net64, d1, d2)
    assert (o32.double() - o64).norm() <= float32_gram_tolerance(net64, d1, d1)
    assert (diag32.double() - diag64).norm() <= float32_gram_tolerance(net64, d1, d1)


def test_tables_never_form_a_dense_row_and_pairs_come_in_blocks(monkeypatch):
    """A table of 5,000 tokens: the Gram of equal tokens needs the (example, token) sums only (a dense per-example
    row would be V·D wide); with blocks of a few pairs each (PAIR_NUMBERS small) the Gram is unchanged."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(5_000, 3), nn.Flatten(), nn.Tanh(), nn.Linear(12, 2)).double().eval()
    x1 = torch.randint(0, 5_000, (6, 4), generator=torch.Generator().manual_seed(1))
    x1[1] = x1[0].flip(0)  # shared tokens across examples, at other positions
    x1[2, 1:] = x1[0, 0]
    engine = NTKEngine(net, chunk_size=4)
    engine.plan(engine.prepare(x1))  # verified on the probe (its one dense row of one example)
    expected = reference(net, x1, x1, "layer")[0]
    engine.core.jacobian_chunk = no_generic_jacobian
    with mock.patch.object(EmbeddingLayer, "jacobians", side_effect=AssertionError("a dense row of the table")):
        monkeypatch.setattr(token_grams, "PAIR_NUMBERS", 40)
        assert rel_err(engine.group_grams(x1), expected) < 1e-10
        assert rel_err(engine.output_grams(x1), expected.view(2, 6, 2, 6, 2).diagonal(dim1=2, dim2=4).permute(
            0, 3, 1, 2)) < 1e-10


@pytest.mark.parametrize("case", ["layernorm_sequences", "cnn_batchnorm2d_groupnorm"])
def test_input_gradients_through_the_norm_rows_match_finite_differences(case):
    """With inputs that require grad, the Grams keep a graph through the norm layers' rows (second-order autograd
    through the features): the gradient of Σ R ⊙ K(z, x) along a random direction against central finite differences
    in float64 (step 1e-6: truncation and rounding errors about 1e-9 of the values here). (torch.func's jacrev gives a
    wrong input gradient of a LayerNorm's parameter Jacobian, the route these parameters took before.)"""
    net, make_x, _ = build(case)
    x0, z = make_x(3, 7), make_x(2, 8)
    direction = make_x(3, 9)
    engine = NTKEngine(net, chunk_size=2)

    def value(x):
        gram = engine.group_grams(z, x).sum(0)
        return (gram * torch.randn(gram.shape, dtype=F64, generator=torch.Generator().manual_seed(0))).sum()

    x = x0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(value(x), x)
    with torch.no_grad():
        fd = ((value(x0 + 1e-6 * direction) - value(x0 - 1e-6 * direction)) / 2e-6).item()
    ad = (grad * direction).sum().item()
    assert abs(ad - fd) <= 1e-6 * max(1.0, abs(fd)) and grad.abs().max() > 0


@pytest.mark.parametrize("case", ["cnn_batchnorm2d_groupnorm", "embedding_mean_pool"])
def test_memory_estimate_counts_the_elementwise_features(case):
    """contracted_width counts the norm layers' columns and the tables' token sums (at most T·D per example and
    output); chunk_bytes bounds what a chunk's pass holds."""
    net, make_x, _ = build(case)
    x = make_x(6, 9)
    engine = NTKEngine(net)
    x = engine.prepare(x)
    plan, c = engine.plan(x), engine.num_outputs(x)
    held = chunk_features(engine.core, plan, x, False).columns
    numbers = sum(t.numel() for t in held.values()) + sum(t.sums.numel() for t in held.tokens)
    assert numbers <= 6 * c * contracted_width(engine.core, plan)
    norms = [la for la in plan.elementwise if not isinstance(la, EmbeddingLayer)]
    assert sum(t.numel() for t in held.values()) == 6 * c * sum(
        p.numel() for la in norms for p in (la.module.weight, la.module.bias)) + 6 * c * sum(
        p.numel() for la in plan.multi for p in (la.module.weight, la.module.bias) if p is not None)
    assert 2 * numbers * 8 <= 6 * chunk_bytes(engine.core, plan, c, 8)


@pytest.mark.parametrize("case", ["layernorm_sequences", "embedding_used_twice"])
def test_fsvi_covariance_and_its_gradients_through_the_elementwise_rows(case):
    """FSVI's linearized covariance J diag(v) Jᵀ and the gradients of <W, Σ> + |f|² in θ and v, with the norm and
    embedding rows from the features (differentiable in θ), against dense Jacobians by
    torch.autograd.functional (tests/fsvi/reference.py). (torch.func's jacrev, these parameters' route before, gives
    a LayerNorm network wrong gradients in θ.)"""
    from ntkgp.fsvi import LinearizedNetwork
    from tests.fsvi import reference as ref

    net, make_x, elementwise = build(case)
    lin = LinearizedNetwork(net)
    x = make_x(4, 3)
    base = {n: p.detach().clone() for n, p in net.named_parameters()}
    variances = ref.random_variances(base)
    assert [la.name for la in lin.plan(base, x).elementwise] == elementwise

    def grads(route):
        params = {k: t.clone().requires_grad_() for k, t in base.items()}
        v = {k: t.clone().requires_grad_() for k, t in variances.items()}
        if route == "structured":
            f, (cov,) = lin.covariance(params, [v], x, create_graph=True)
        else:
            cov = ref.covariance(net, params, v, lin.names, x, create_graph=True)
            f = torch.func.functional_call(net, params, (x,))
        weights = torch.randn(cov.shape, dtype=F64, generator=torch.Generator().manual_seed(0))
        ((weights * cov).sum() + f.square().sum()).backward()
        return cov.detach(), [params[k].grad for k in lin.names] + [v[k].grad for k in lin.names]

    (cov, got), (expected, want) = grads("structured"), grads("dense")
    assert rel_err(cov, expected) < 1e-10
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
