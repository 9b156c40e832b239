"""The projections of ``nn.MultiheadAttention`` as shared linear layers and a learned position added to the
activations (issue 39, item 3): the NTK's layer plan takes them structured (no generic parameter left in a small
transformer), and its Gram equals the dense one from per-example autograd Jacobians (tests.helpers.brute_jacobian,
on the user's own network: torch's attention, not ntkgp's recorded one).

Tolerances: float64 Grams to 1e-10 relative (the same sums in another order: κ·ε with κ ≲ 1e4 here); a float32
network against its float64 copy within tests.helpers.float32_gram_tolerance (r·ε·√(tr K tr K'), with the
attention's products and softmax counted as layers).
"""

import copy

import pytest
import torch
from torch import nn

from ntkgp.ntk import NetworkCore, NTKEngine
from tests.helpers import brute_jacobian, float32_gram_tolerance, float32_roundings

D, T, C = 4, 3, 2


class Encoder(nn.Module):
    """A learned position added to the inputs, one ``nn.TransformerEncoderLayer`` (or a bare attention), mean
    pooling, a linear head; inputs flat ``(N, T·D)``. With ``masked`` the positions whose first feature exceeds 0.8
    (never the first) are padding keys."""

    def __init__(self, batch_first: bool = True, masked: bool = False, bare: bool = False, **attention) -> None:
        super().__init__()
        self.batch_first, self.masked, self.bare = batch_first, masked, bare
        self.position = nn.Parameter(0.3 * torch.randn(T, D))
        if bare:
            self.attention = nn.MultiheadAttention(D, 2, batch_first=batch_first, **attention)
        else:
            self.layer = nn.TransformerEncoderLayer(D, 2, 6, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = x.view(-1, T, D) + self.position
        mask = None
        if self.masked:
            mask = h[..., 0] > 0.8
            mask[:, 0] = False
        h = h if self.batch_first else h.transpose(0, 1)
        if self.bare:
            h = self.attention(h, h, h, key_padding_mask=mask)[0]
        else:
            h = self.layer(h, src_key_padding_mask=mask)
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head(h.mean(dim=1))


class CrossAttention(nn.Module):
    """Queries from the first half of the positions, keys and values from the second (``same_kv``: one tensor)
    or keys and values from different halves; a causal mask and the attention weights' path (``need_weights``)."""

    def __init__(self, same_kv: bool = True, need_weights: bool = True) -> None:
        super().__init__()
        self.same_kv, self.need_weights = same_kv, need_weights
        self.attention = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = x.view(-1, 2 * T, D)
        q, kv = h[:, :T], h[:, T:]
        v = kv if self.same_kv else torch.tanh(kv)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        out = self.attention(q, kv, v, attn_mask=mask, need_weights=self.need_weights)[0]
        return self.head(out.mean(dim=1))


def build(cls, dtype=torch.float64, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    net = cls(**kwargs).to(dtype).eval()
    with torch.no_grad():  # biases away from zero: every parameter's Jacobian columns are non-trivial
        for name, p in net.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return net


def inputs(n: int, width: int, seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def dense_gram(net: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    j1, _ = brute_jacobian(net, x1)
    j2, _ = brute_jacobian(net, x2)
    return j1 @ j2.T


def structured_names(net: nn.Module, x: torch.Tensor) -> tuple[set[str], tuple[str, ...]]:
    core = NetworkCore(net)
    plan = core.layer_plan(core.prepare(x))
    names = {n for layer in (*plan.layers, *plan.elementwise) for n in layer.parameter_names}
    return names, plan.generic


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_transformer_gram_is_exact_with_attention_and_position_structured(batch_first, masked):
    net = build(Encoder, batch_first=batch_first, masked=masked)
    x1, x2 = inputs(5, T * D), inputs(4, T * D, seed=2)
    if masked:
        assert bool((x1.view(-1, T, D)[:, 1:, 0] + net.position[1:, 0].detach() > 0.8).any())  # a key is padded
    names, generic = structured_names(net, x1)
    # sequence-first (T, N, D) tensors: the encoder layer's feed-forward Linear and LayerNorm layers do not see the
    # batch first and stay generic; attention's projections and the position are structured either way
    assert all(n.startswith(("layer.linear", "layer.norm")) for n in generic)
    assert (generic == ()) == batch_first
    assert {"layer.self_attn.in_proj_weight", "layer.self_attn.in_proj_bias", "layer.self_attn.out_proj.weight",
            "position"} <= names
    gram = NTKEngine(net, prior_structure="network").group_grams(x1, x2)[0]
    reference = dense_gram(net, x1, x2)
    torch.testing.assert_close(gram, reference, rtol=1e-10, atol=1e-10 * reference.abs().max().item())


@pytest.mark.parametrize("same_kv", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_cross_attention_gram_is_exact(same_kv, need_weights):
    """Queries and keys from different tensors: the in-projection's inputs stacked along the positions (the rows of
    another role get zero gradient), with a causal mask, by either attention path."""
    net = build(CrossAttention, same_kv=same_kv, need_weights=need_weights)
    x1, x2 = inputs(4, 2 * T * D), inputs(3, 2 * T * D, seed=2)
    names, generic = structured_names(net, x1)
    assert generic == () and "attention.in_proj_weight" in names
    engine = NTKEngine(net, prior_structure="layer")
    gram = engine.group_grams(x1, x2).sum(dim=0)
    reference = dense_gram(net, x1, x2)
    torch.testing.assert_close(gram, reference, rtol=1e-10, atol=1e-10 * reference.abs().max().item())
    locations = engine.plan(engine.prepare(x1)).locations["attention"]
    assert locations == (2 * T if same_kv else 3 * T)


@pytest.mark.parametrize("attention", [{"bias": False}, {"kdim": 3, "vdim": 5}, {"add_bias_kv": True},
                                       {"add_zero_attn": True}])
def test_other_attention_configurations_stay_exact(attention):
    """No bias: the projections' weights alone; separate q/k/v weights (kdim, vdim), ``bias_k``/``bias_v`` and
    ``add_zero_attn``: the in-projection generic (the out-projection structured where the computation is covered)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(D, 2, batch_first=True, **attention)
            self.kproj = nn.Linear(D, attention.get("kdim", D))
            self.vproj = nn.Linear(D, attention.get("vdim", D))
            self.head = nn.Linear(D, C)

        def forward(self, x):
            h = x.view(-1, T, D)
            return self.head(self.attention(h, self.kproj(h), self.vproj(h))[0].mean(dim=1))

    net = Net().double().eval()
    x1, x2 = inputs(4, T * D), inputs(3, T * D, seed=2)
    names, generic = structured_names(net, x1)
    if "kdim" in attention:
        assert "attention.q_proj_weight" in generic and "attention.out_proj.weight" in names
    elif attention.get("add_bias_kv") or attention.get("add_zero_attn"):
        assert "attention.in_proj_weight" in generic and "attention.out_proj.weight" in generic
    else:
        assert generic == ()
    gram = NTKEngine(net, prior_structure="network").group_grams(x1, x2)[0]
    reference = dense_gram(net, x1, x2)
    torch.testing.assert_close(gram, reference, rtol=1e-10, atol=1e-10 * reference.abs().max().item())


def test_attention_called_twice_and_a_sliced_position_take_the_generic_route():
    """One attention module applied twice and a position used through a slice fail the plan's check against
    autograd: generic, and the Gram stays exact."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.position = nn.Parameter(torch.randn(T + 2, D))
            self.attention = nn.MultiheadAttention(D, 2, batch_first=True)
            self.head = nn.Linear(D, C)

        def forward(self, x):
            h = x.view(-1, T, D) + self.position[:T]
            h = self.attention(h, h, h)[0]
            return self.head(self.attention(h, h, h)[0].mean(dim=1))

    torch.manual_seed(0)
    net = Twice().double().eval()
    x1, x2 = inputs(4, T * D), inputs(3, T * D, seed=2)
    _, generic = structured_names(net, x1)
    assert {"position", "attention.in_proj_weight", "attention.out_proj.weight"} <= set(generic)
    gram = NTKEngine(net, prior_structure="network").group_grams(x1, x2)[0]
    reference = dense_gram(net, x1, x2)
    torch.testing.assert_close(gram, reference, rtol=1e-10, atol=1e-10 * reference.abs().max().item())


def test_float32_gram_agrees_with_its_float64_copy():
    net64 = build(Encoder, masked=True)
    net32 = copy.deepcopy(net64).float()
    x1, x2 = inputs(5, T * D), inputs(4, T * D, seed=2)
    k64 = NTKEngine(net64, prior_structure="network").group_grams(x1, x2)[0]
    k32 = NTKEngine(net32, prior_structure="network").group_grams(x1.float(), x2.float())[0]
    d1 = NTKEngine(net64, prior_structure="network").group_grams(x1)[0].diagonal()
    d2 = NTKEngine(net64, prior_structure="network").group_grams(x2)[0].diagonal()
    # attention's two products and softmax between the projections: 3 more rounding layers each way
    tolerance = float32_gram_tolerance(net64, d1, d2, roundings=float32_roundings(net64) + 6)
    assert (k32.double() - k64).norm() <= tolerance


def test_the_users_module_is_left_as_it_was():
    """The recording runs on ntkgp's private copy: no forward attribute, hook or torch-function mode stays on the
    user's modules, and no mode is left active after a pass."""
    net = build(Encoder, masked=True)
    before = {name: dict(module.__dict__) for name, module in net.named_modules()}
    NTKEngine(net, prior_structure="network").group_grams(inputs(3, T * D))
    assert not torch._C._is_torch_function_mode_enabled()
    for name, module in net.named_modules():
        assert "forward" not in module.__dict__
        assert module.__dict__.keys() == before[name].keys()


def test_additive_parameters_of_other_shapes_and_owners_are_structured_and_exact():
    """A position ``(1, T, D)`` added as ``p + h`` inside a submodule's forward and a shift ``(D,)`` broadcast over
    the positions (its rows summed over them) and added twice; a sequence of one position (the projections'
    single-location route)."""

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(1, T, D))

        def forward(self, h):
            return self.table + h

    class Net(nn.Module):
        def __init__(self, length):
            super().__init__()
            self.length = length
            self.positions = Positions() if length == T else None
            self.shift = nn.Parameter(torch.randn(D))
            self.attention = nn.MultiheadAttention(D, 2, batch_first=True)
            self.head = nn.Linear(D, C)

        def forward(self, x):
            h = x.view(-1, self.length, D)
            h = self.positions(h) if self.positions is not None else h
            h = self.attention(h, h, h)[0] + self.shift
            return self.head((torch.tanh(h) + self.shift).mean(dim=1))  # the shift added twice: its calls summed

    for length in (T, 1):
        torch.manual_seed(0)
        net = Net(length).double().eval()
        x1, x2 = inputs(4, length * D), inputs(3, length * D, seed=2)
        names, generic = structured_names(net, x1)
        assert generic == () and "shift" in names and (length == 1 or "positions.table" in names)
        gram = NTKEngine(net, prior_structure="layer").group_grams(x1, x2).sum(dim=0)
        reference = dense_gram(net, x1, x2)
        torch.testing.assert_close(gram, reference, rtol=1e-10, atol=1e-10 * reference.abs().max().item())
