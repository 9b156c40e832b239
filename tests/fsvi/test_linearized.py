"""The structured covariance J diag(v) Jᵀ against dense autograd Jacobians."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntkgp.fsvi import LinearizedNetwork
from tests.helpers import float32_gram_tolerance

from . import reference as ref


def _params(net):
    return {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}


def _snapshot(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, sum(len(m._forward_hooks) for m in net.modules())


def _check_unchanged(net, before):
    state, hooks = before
    assert sum(len(m._forward_hooks) for m in net.modules()) == hooks
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]), k


class TwiceUsed(nn.Module):
    """A linear layer applied twice, and a second layer sharing the first one's weight: not structured."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(self.a(x))))))


class Scaled(nn.Module):
    """A network whose outputs are its last layer's times 2: that layer's output gradients are not the unit vectors
    (the pair contraction, not the output layer's shortcut)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return 2 * self.net(x)


NETS = {
    "mlp_c1": lambda: (ref.mlp(d_out=1), (3,)),
    "mlp_c3": lambda: (ref.mlp(d_out=3), (3,)),
    "mlp_c3_scaled": lambda: (Scaled(ref.mlp(d_out=3)), (3,)),
    "cnn": lambda: (ref.small_cnn(3), (1, 6, 6)),
    "twice": lambda: (TwiceUsed().double(), (3,)),
}


@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("strategy", ["auto", "contraction"])
def test_covariance_equals_dense_jacobians(name, strategy):
    net, shape = NETS[name]()
    before = _snapshot(net)
    lin = LinearizedNetwork(net, strategy=strategy, chunk_size=3)
    params = ref.random_like(_params(net))
    elementwise = ref.random_variances(params)
    constant = {n: torch.tensor(0.3 + i, dtype=torch.float64) for i, n in enumerate(params)}
    mixed = {n: (elementwise[n] if i % 2 else constant[n]) for i, n in enumerate(params)}
    x1 = torch.randn(5, *shape, dtype=torch.float64)
    x2 = torch.randn(4, *shape, dtype=torch.float64)
    names = lin.names
    for v in (elementwise, constant, mixed):
        expected = ref.covariance(net, params, v, names, x1)
        f, (cov,) = lin.covariance(params, [v], x1, create_graph=False)
        torch.testing.assert_close(cov, expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(f, torch.func.functional_call(net, params, (x1,)), rtol=1e-12, atol=1e-12)
        cross = lin.cross_covariance(params, v, x1, x2)
        torch.testing.assert_close(cross, ref.covariance(net, params, v, names, x1, x2), rtol=1e-10, atol=1e-10)
        _, blocks = lin.diag_blocks(params, v, x1)
        c = f.shape[1]
        dense_blocks = expected.view(5, c, 5, c).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
        torch.testing.assert_close(blocks, dense_blocks, rtol=1e-10, atol=1e-10)
    _check_unchanged(net, before)


def test_routes_chosen():
    lin = LinearizedNetwork(ref.small_cnn(3))
    params = _params(lin.net)
    plan = lin.plan(params, torch.randn(2, 1, 6, 6, dtype=torch.float64))
    assert [la.name for la in plan.single] == ["fc", "head"]
    assert [la.name for la in plan.layers] == ["conv", "fc", "head"]  # the convolution from its features
    assert plan.generic == () and [la.name for la in plan.elementwise] == ["bn"]  # BatchNorm: rows from the features
    twice = LinearizedNetwork(TwiceUsed().double())
    plan = twice.plan(_params(twice.net), torch.randn(2, 3, dtype=torch.float64))
    assert [la.name for la in plan.single] == ["out"]  # a is called twice, b shares its weight
    assert plan.generic == ("a.weight", "a.bias", "b.bias")


@pytest.mark.parametrize("variances", ["elementwise", "constant"])
@pytest.mark.parametrize("name", ["mlp_c3", "mlp_c3_scaled", "cnn"])
def test_covariance_gradients_match_dense(name, variances):
    """d/dθ and d/dv of <W, Σ> through the structured route equal those through dense autograd Jacobians, with
    element-wise variances (pair contraction; the output layer's shortcut unless scaled) and one variance per
    tensor (the NTK's form, its Gram with a one-product backward pass)."""
    net, shape = NETS[name]()
    lin = LinearizedNetwork(net)
    x = torch.randn(4, *shape, dtype=torch.float64)
    base = ref.random_like(_params(net))
    var = ref.random_variances(base)
    if variances == "constant":
        var = {n: torch.tensor(0.3 + i, dtype=torch.float64) for i, n in enumerate(base)}
    n = 4 * 3
    weights = torch.randn(n, n, dtype=torch.float64)

    def grads(route):
        params = {k: t.clone().requires_grad_() for k, t in base.items()}
        v = {k: t.clone().requires_grad_() for k, t in var.items()}
        if route == "structured":
            f, (cov,) = lin.covariance(params, [v], x, create_graph=True)
        else:
            cov = ref.covariance(net, params, v, lin.names, x, create_graph=True)
            f = torch.func.functional_call(net, params, (x,))
        ((weights * cov).sum() + f.square().sum()).backward()
        return [params[k].grad for k in lin.names] + [v[k].grad for k in lin.names]

    for got, want in zip(grads("structured"), grads("dense")):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_float32_and_flat_inputs():
    net = ref.small_cnn(2, dtype=torch.float32)
    lin = LinearizedNetwork(net, input_shape=(1, 6, 6))
    params = _params(net)
    v = {k: torch.full_like(t, 0.5) for k, t in params.items()}
    x = torch.randn(3, 36)
    _, (cov,) = lin.covariance(params, [v], lin.prepare(x, params["conv.weight"]), create_graph=False)
    assert cov.dtype == torch.float32
    params64 = {k: t.double() for k, t in params.items()}
    expected = ref.covariance(net.double(), params64, {k: t.double() for k, t in v.items()}, lin.names,
                              x.double().view(3, 1, 6, 6))
    # J diag(v) Jᵀ is an NTK Gram with element-wise weights: from float32 Jacobian rows (r = float32_roundings
    # relative roundings each) summed over P products, so ‖ΔΣ‖_F ≤ rε√(tr Σ tr Σ) (tests.helpers.float32_gram_tolerance,
    # the trace measured on the float64 reference; ≈ 3e-6 relative here, below a 100ε32 error's ≈ 1e-5)
    assert (cov.double() - expected).norm() <= float32_gram_tolerance(net, expected.diagonal())


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="net"):
        LinearizedNetwork("not a net")
    with pytest.raises(ValueError, match="strategy"):
        LinearizedNetwork(ref.mlp(), strategy="fast")
    bn = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    with pytest.raises(ValueError, match="training mode"):
        LinearizedNetwork(bn)
    lin = LinearizedNetwork(ref.mlp(), input_shape=(3,))
    with pytest.raises(ValueError, match="x_test"):
        lin.prepare(torch.randn(2, 4), next(ref.mlp().parameters()), "x_test")


@pytest.mark.parametrize("chunk_elements", [1, 50, 150, 2**18])  # float64 numbers per chunk
def test_pair_contraction_value_and_gradients_against_autograd(monkeypatch, chunk_elements):
    """The chunked contraction T[n,c,m,d] = Σ_i γ1[n,c,i] B[n,m,i] γ2[m,d,i] (one column per chunk, a few, all)
    equals the einsum, and its hand-written backward passes torch.autograd.gradcheck; so does the symmetric
    variant (blocks n ≤ m computed and mirrored)."""
    from ntkgp.fsvi.pair_contraction import PairContraction

    monkeypatch.setattr(PairContraction, "CHUNK_BYTES", 8 * chunk_elements)
    torch.manual_seed(0)
    g1 = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 6, 4, dtype=torch.float64, requires_grad=True)
    g2 = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    reference = torch.einsum("nci,nmi,mdi->ncmd", g1, b, g2).reshape(5, 3, 18)
    torch.testing.assert_close(PairContraction.apply(g1, b, g2), reference, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(PairContraction.apply, (g1, b, g2))
    # the same γ on both sides, general and symmetric routes
    g = g2.detach().clone().requires_grad_()
    bs = torch.randn(6, 6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda gg, bb: PairContraction.apply(gg, bb, gg), (g, bs))
    sym = (bs + bs.transpose(0, 1)).detach() / 2
    torch.testing.assert_close(PairContraction.apply(g, sym, g, True),
                               torch.einsum("nci,nmi,mdi->ncmd", g, sym, g).reshape(6, 3, 18), rtol=1e-12, atol=1e-12)
    # it reads only the blocks n ≤ m of B: zero below gives the same result
    upper = sym * torch.ones(6, 6, dtype=torch.bool).triu()[:, :, None]
    torch.testing.assert_close(PairContraction.apply(g, upper, g, True),
                               torch.einsum("nci,nmi,mdi->ncmd", g, sym, g).reshape(6, 3, 18), rtol=1e-12, atol=1e-12)
    # differentiate through a symmetric B
    assert torch.autograd.gradcheck(
        lambda gg, bb: PairContraction.apply(gg, (bb + bb.transpose(0, 1)) / 2, gg, True), (g, bs))
    # any B: the symmetric route is the contraction of the symmetric B built from its blocks n ≤ m (and the lower
    # blocks get no gradient)
    upper_of = torch.ones(6, 6, dtype=torch.bool).triu()[:, :, None]
    from_upper = torch.where(upper_of, bs, bs.transpose(0, 1)).detach()
    torch.testing.assert_close(PairContraction.apply(g, bs, g, True),
                               torch.einsum("nci,nmi,mdi->ncmd", g, from_upper, g).reshape(6, 3, 18), rtol=1e-12,
                               atol=1e-12)
    assert torch.autograd.gradcheck(lambda gg, bb: PairContraction.apply(gg, bb, gg, True), (g, bs))
    (grad_b,) = torch.autograd.grad(PairContraction.apply(g, bs, g, True).sum(), bs)
    assert grad_b.masked_select(~upper_of).eq(0).all()
