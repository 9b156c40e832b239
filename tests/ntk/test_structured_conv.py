"""The structured route for nn.Conv2d (and linear layers with several locations) against brute-force
autograd Jacobians, and the fallback to contraction for what the safety rule does not cover."""

import pytest
import torch
from torch import nn

from ntkgp.ntk import NTKEngine, resolve_groups
from tests.helpers import assert_unchanged, brute_jacobian, column_groups, float32_gram_tolerance, rel_err, snapshot


class ConvNet(nn.Module):
    """Two convolutions (configurable), a pooled linear head; no normalisation layer."""

    def __init__(self, first: dict, second: dict, c_out: int = 3, size: int = 7) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, **first)
        self.conv2 = nn.Conv2d(3, 4, **second)
        with torch.no_grad():
            spatial = self.conv2(self.conv1(torch.zeros(1, 2, size, size))).shape[-2:].numel()
        self.head = nn.Linear(4 * spatial, c_out)

    def forward(self, x):
        return self.head(torch.tanh(self.conv2(torch.tanh(self.conv1(x)))).flatten(1))


CONFIGS = {
    "plain": ({"kernel_size": 3}, {"kernel_size": 2}),
    "stride_padding": ({"kernel_size": 3, "stride": 2, "padding": 1}, {"kernel_size": 2, "padding": (1, 0)}),
    "dilation_no_bias": ({"kernel_size": 2, "dilation": 2, "bias": False}, {"kernel_size": (1, 3), "stride": (2, 1)}),
    "valid": ({"kernel_size": 3, "padding": "valid"}, {"kernel_size": 1}),
}


def conv_net(config: str, c_out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    first, second = CONFIGS[config]
    return ConvNet(first, second, c_out).double().eval()


def reference_grams(net, x1, x2, prior_structure):
    pg = resolve_groups(net, prior_structure)
    labels = dict(zip(pg.names, pg.group_of))
    j1, _ = brute_jacobian(net, x1)
    j2, _ = brute_jacobian(net, x2)
    cols = column_groups(net, labels)
    return torch.stack([j1[:, cols == g] @ j2[:, cols == g].T for g in range(pg.num_groups)])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("prior_structure", ["layer", "parameter"])
def test_conv_grams_match_brute_force_without_contraction(config, prior_structure):
    net = conv_net(config)
    torch.manual_seed(1)
    x1, x2 = torch.randn(5, 2, 7, 7, dtype=torch.float64), torch.randn(3, 2, 7, 7, dtype=torch.float64)
    engine = NTKEngine(net, prior_structure=prior_structure, strategy="structured", chunk_size=2)
    plan = engine.plan(x1)
    assert plan.generic == () and [la.name for la in plan.multi] == ["conv1", "conv2"]
    assert [la.name for la in plan.single] == ["head"]

    def no_jacobian(*args, **kwargs):
        raise AssertionError("vmap(jacrev) Jacobian formed")

    engine.core.jacobian_chunk = no_jacobian
    before = snapshot(net)
    sym, cross = engine.group_grams(x1), engine.group_grams(x1, x2)
    assert_unchanged(net, before)
    assert rel_err(sym, reference_grams(net, x1, x1, prior_structure)) < 1e-10
    assert rel_err(cross, reference_grams(net, x1, x2, prior_structure)) < 1e-10
    g, c = engine.num_groups, 3
    per_output, diag = engine.output_grams(x1, x2, with_diagonal=True)
    ref = cross.view(g, 5, c, 3, c).diagonal(dim1=2, dim2=4).permute(0, 3, 1, 2)
    assert rel_err(per_output, ref) < 1e-10
    ref_blocks = torch.stack([reference_grams(net, x2[i : i + 1], x2[i : i + 1], prior_structure) for i in range(3)], 1)
    assert rel_err(diag, ref_blocks.diagonal(dim1=-2, dim2=-1)) < 1e-10
    assert rel_err(engine.diag_blocks(x2), ref_blocks) < 1e-10


def test_conv_matvec_equals_brute_force_gram_product():
    net = conv_net("stride_padding")
    x = torch.randn(6, 2, 7, 7, dtype=torch.float64)
    engine = NTKEngine(net, chunk_size=4)
    weights = torch.rand(engine.num_groups, dtype=torch.float64) + 0.5
    gram = torch.einsum("g,gij->ij", weights, reference_grams(net, x, x, "layer"))
    v = torch.randn(gram.shape[0], 2, dtype=torch.float64)
    assert rel_err(engine.matvec(x, v, weights), gram @ v) < 1e-10


def test_linear_layer_on_sequences_takes_the_expanded_form():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(8, 2)).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    engine = NTKEngine(net, strategy="structured")
    plan = engine.plan(x)
    assert [la.name for la in plan.multi] == ["0"] and plan.generic == ()
    assert rel_err(engine.group_grams(x), reference_grams(net, x, x, "layer")) < 1e-10


def test_grouped_convolutions_fall_back_to_contraction():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(36, 2)).double()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    for strategy in ("auto", "structured"):  # not an unsafe layer: contraction, no error
        engine = NTKEngine(net, strategy=strategy)
        plan = engine.plan(x)
        assert plan.names == ("3",) and plan.generic == ("0.weight", "0.bias")
        assert isinstance(plan.problems["0"], NotImplementedError)
        assert rel_err(engine.group_grams(x), reference_grams(net, x, x, "layer")) < 1e-10


@pytest.mark.parametrize(
    ("conv", "features"),
    [
        (lambda: nn.Conv2d(2, 3, 3, padding="same"), 75),
        (lambda: nn.Conv2d(2, 3, (2, 3), padding="same", dilation=(2, 1)), 75),  # even kernel: uneven padding
        (lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), 75),
        (lambda: nn.Conv2d(2, 3, 3, padding=(2, 1), padding_mode="replicate"), 105),
        (lambda: nn.Conv2d(2, 3, 2, padding=1, padding_mode="circular", stride=2), 27),
    ],
    ids=["same", "same_even_dilated", "reflect", "replicate", "circular_strided"],
)
def test_every_padding_takes_the_structured_form(conv, features):
    """'same' padding (odd and even kernels) and the non-zero padding modes: patches padded as the layer pads."""
    torch.manual_seed(0)
    net = nn.Sequential(conv(), nn.Tanh(), nn.Flatten(), nn.Linear(features, 2)).double()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    engine = NTKEngine(net, strategy="structured")
    plan = engine.plan(x)
    assert plan.names == ("0", "3") and plan.generic == () and [la.name for la in plan.multi] == ["0"]
    assert rel_err(engine.group_grams(x), reference_grams(net, x, x, "layer")) < 1e-10


class OutsideUse(nn.Module):
    """The convolution's weight is also used functionally outside its forward: the probe catches it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.head = nn.Linear(2 * 3 * 3 * 2, 1)

    def forward(self, x):
        a = self.conv(x)
        b = nn.functional.conv2d(x, self.conv.weight.flip(-1))
        return self.head(torch.cat([a, b], 1).flatten(1))


def test_weight_used_outside_forward_is_not_structured():
    torch.manual_seed(0)
    net = OutsideUse().double()
    x = torch.randn(4, 1, 5, 5, dtype=torch.float64)
    engine = NTKEngine(net)
    plan = engine.plan(x)
    assert plan.names == ("head",) and plan.generic == ("conv.weight", "conv.bias")
    assert rel_err(engine.group_grams(x), reference_grams(net, x, x, "layer")) < 1e-10
    with pytest.raises(ValueError, match="strategy='structured'.*conv"):
        NTKEngine(net, strategy="structured").group_grams(x)


def test_shared_weight_between_modules_is_rejected_by_structured():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    net[2].weight = net[0].weight
    x = torch.randn(5, 3, dtype=torch.float64)
    plan = NTKEngine(net).plan(x)
    assert plan.names == ("4",)
    assert rel_err(NTKEngine(net).group_grams(x), reference_grams(net, x, x, "layer")) < 1e-10
    with pytest.raises(ValueError, match="shared"):
        NTKEngine(net, strategy="structured").group_grams(x)


def test_float32_conv_agrees_with_float64():
    net64 = conv_net("plain")
    net32 = conv_net("plain").float()
    x = torch.randn(6, 2, 7, 7, dtype=torch.float64)
    k64 = NTKEngine(net64).group_grams(x)
    k32 = NTKEngine(net32).group_grams(x.float())
    assert k32.dtype == torch.float32 and [la.name for la in NTKEngine(net32).plan(x.float()).multi] == ["conv1", "conv2"]
    tolerance = float32_gram_tolerance(net64, k64.diagonal(dim1=-2, dim2=-1))  # per group: ε·r·tr K_g
    assert (k32.double() - k64).norm() <= tolerance
