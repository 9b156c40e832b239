"""Input gradients: every engine result keeps a correct autograd graph to an input that requires grad, in
both routes (second-order autograd through the features and through vmap(jacrev)); checked against central
finite differences in float64 along random directions."""

import pytest
import torch

from ntkgp.ntk import NTKEngine
from tests.helpers import mlp, small_cnn, snapshot, assert_unchanged

CASES = {
    "mlp_c1": (lambda: mlp(d_out=1), (4, 3)),
    "mlp_c3": (lambda: mlp(d_out=3), (4, 3)),
    "cnn": (lambda: small_cnn(c_out=2), (3, 1, 6, 6)),
}


def weighted_sum(value) -> torch.Tensor:
    """Σ R ⊙ value with a fixed random R per shape (so no symmetry hides an error)."""
    if isinstance(value, dict):
        return sum(weighted_sum(v) for v in value.values())
    if isinstance(value, tuple):
        return sum(weighted_sum(v) for v in value)
    generator = torch.Generator().manual_seed(value.numel())
    return (torch.randn(value.shape, generator=generator, dtype=value.dtype) * value).sum()


def quantities(engine: NTKEngine, x2: torch.Tensor, c: int):
    g = engine.num_groups
    weights = torch.linspace(0.5, 2.0, g, dtype=torch.float64)
    tangents = {n: torch.randn(*s, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                for i, (n, s) in enumerate(zip(engine.groups.names, engine.groups.shapes))}

    def v_for(x):
        return torch.randn(x.shape[0] * c, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    return {
        "outputs": lambda x: engine.outputs(x),
        "jacobian": lambda x: engine.jacobian(x),
        "group_grams_sym": lambda x: engine.group_grams(x),
        "group_grams_x1": lambda x: engine.group_grams(x, x2),
        "group_grams_x2": lambda x: engine.group_grams(x2, x),
        "output_grams": lambda x: engine.output_grams(x, x2, with_diagonal=True),
        "output_grams_sym": lambda x: engine.output_grams(x, with_diagonal=True),
        "diag_blocks": lambda x: engine.diag_blocks(x),
        "vjp": lambda x: engine.vjp(x, v_for(x)),
        "jvp": lambda x: engine.jvp(x, tangents),
        "matvec": lambda x: engine.matvec(x, v_for(x), weights),
    }


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", ["auto", "contraction"])
def test_input_gradients_match_finite_differences(case, strategy):
    make_net, shape = CASES[case]
    net = make_net()
    engine = NTKEngine(net, strategy=strategy, chunk_size=2)
    torch.manual_seed(3)
    x0 = torch.randn(shape, dtype=torch.float64)
    x2 = torch.randn(shape, dtype=torch.float64)[:2]
    c = engine.num_outputs(x0)
    before = snapshot(net)
    direction = torch.randn(shape, dtype=torch.float64)
    eps = 1e-6
    for name, fn in quantities(engine, x2, c).items():
        x = x0.clone().requires_grad_(True)
        value = weighted_sum(fn(x))
        (grad,) = torch.autograd.grad(value, x)
        with torch.no_grad():
            up = weighted_sum(fn(x0 + eps * direction))
            down = weighted_sum(fn(x0 - eps * direction))
        fd = ((up - down) / (2 * eps)).item()
        ad = (grad * direction).sum().item()
        assert abs(ad - fd) <= 1e-6 * max(1.0, abs(fd)), (name, ad, fd)
    assert_unchanged(net, before)


def test_fast_path_has_no_graph():
    net = mlp(d_out=2)
    engine = NTKEngine(net)
    x = torch.randn(5, 3, dtype=torch.float64)
    for value in (engine.outputs(x), engine.group_grams(x), engine.diag_blocks(x), engine.output_grams(x)):
        assert not value.requires_grad
    xg = x.clone().requires_grad_(True)
    with torch.no_grad():
        assert not engine.group_grams(xg).requires_grad
    assert engine.group_grams(xg).requires_grad
    assert all(p.grad is None for p in net.parameters())


def test_gradients_do_not_reach_the_network():
    net = small_cnn()
    engine = NTKEngine(net)
    x = torch.randn(3, 1, 6, 6, dtype=torch.float64, requires_grad=True)
    before = snapshot(net)
    engine.group_grams(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert_unchanged(net, before)
    assert all(p.grad is None for p in net.parameters())
