"""The shared layer features (ntkgp.ntk.features) and the layer plan (ntkgp.ntk.layer_plan) against brute-force
autograd Jacobians."""

import pytest
import torch
from torch import nn

from ntkgp.ntk.features import layer_features
from ntkgp.ntk.layer_plan import candidate_layers, verify_layers
from ntkgp.ntk.functional import per_example_vjps
from tests.helpers import assert_unchanged, brute_jacobian, rel_err, snapshot


def conv_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(18, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def columns(net, x, names):
    """Brute-force Jacobian columns per parameter name, ``{name: (n, C, numel)}``."""
    jac, order = brute_jacobian(net, x)
    n, c = x.shape[0], jac.shape[0] // x.shape[0]
    out, start = {}, 0
    for name, p in net.named_parameters():
        out[name] = jac[:, start : start + p.numel()].reshape(n, c, -1)
        start += p.numel()
    return {k: out[k] for k in names}


def test_layer_jacobians_from_features_equal_brute_force():
    net = conv_mlp()
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    names = [n for n, _ in net.named_parameters()]
    params = {n: p.detach() for n, p in net.named_parameters()}
    layers, problems = candidate_layers(net, names)
    assert problems == {} and [layer.name for layer in layers] == ["0", "3", "5"]
    before = snapshot(net)
    kept, locations, failed = verify_layers(net, params, layers, x[:1])
    assert len(kept) == 3 and failed == {} and locations == {"0": 9, "3": 1, "5": 1}
    feats = layer_features(net, params, kept, x)
    assert_unchanged(net, before)
    reference = columns(net, x, names)
    for layer in kept:
        for name, block in layer.jacobians(feats.inputs[layer.name], feats.grads[layer.name]).items():
            assert rel_err(block, reference[name]) < 1e-12, name


def test_cotangents_give_vector_jacobian_products():
    net = conv_mlp()
    x = torch.randn(3, 1, 6, 6, dtype=torch.float64)
    params = {n: p.detach() for n, p in net.named_parameters()}
    layers, _ = candidate_layers(net, list(params))
    u = torch.randn(3, 3, 2, dtype=torch.float64)
    feats = layer_features(net, params, layers, x, cotangents=u)
    reference = columns(net, x, list(params))
    for layer in layers:
        for name, block in layer.jacobians(feats.inputs[layer.name], feats.grads[layer.name]).items():
            expected = torch.einsum("ncp,ncm->nmp", reference[name], u)
            assert rel_err(block, expected) < 1e-12
            assert rel_err(block, per_example_vjps(net, params, x, u, [name])) < 1e-12


def test_graph_to_parameters_that_require_grad():
    """With ``graph=True`` and live parameters, d/dθ of a Gram from features matches finite differences."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    layers, _ = candidate_layers(net, [n for n, _ in net.named_parameters()])
    weights = torch.randn(10, 10, dtype=torch.float64)

    def gram_sum(params):
        feats = layer_features(net, params, layers, x, graph=True)
        blocks = [b.reshape(10, -1) for layer in layers
                  for b in layer.jacobians(feats.inputs[layer.name], feats.grads[layer.name]).values()]
        j = torch.cat(blocks, 1)
        return (weights * (j @ j.T)).sum()

    theta = {n: p.detach().clone().requires_grad_(True) for n, p in net.named_parameters()}
    (grad,) = torch.autograd.grad(gram_sum(theta), theta["0.weight"])
    direction = torch.randn_like(grad)
    eps = 1e-6
    with torch.no_grad():
        up = gram_sum({**theta, "0.weight": theta["0.weight"] + eps * direction})
        down = gram_sum({**theta, "0.weight": theta["0.weight"] - eps * direction})
    fd = ((up - down) / (2 * eps)).item()
    assert abs((grad * direction).sum().item() - fd) <= 1e-6 * max(1.0, abs(fd))


def test_hooks_are_removed_when_the_forward_fails():
    net = conv_mlp()
    params = {n: p.detach() for n, p in net.named_parameters()}
    layers, _ = candidate_layers(net, list(params))
    before = snapshot(net)
    with pytest.raises(RuntimeError):
        layer_features(net, params, layers, torch.randn(2, 1, 5, 7, dtype=torch.float64))
    assert_unchanged(net, before)


@pytest.mark.parametrize("frozen", [False, True])
def test_the_networks_own_call_gives_the_features_of_the_functional_one(frozen):
    """``params=None``: the network called as it is (its parameters, which require grad, carry the graph):
    Jacobians equal brute force and the functional pass's features bit for bit, ``.grad`` and the flags left
    alone; with a layer's parameters frozen (``own_graph`` false) the core takes the functional pass."""
    from ntkgp.ntk.features import own_graph
    from ntkgp.ntk.network import NetworkCore

    net = conv_mlp()
    names = [n for n, _ in net.named_parameters()]
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    jacobians = columns(net, x, names)
    if frozen:
        net[3].weight.requires_grad_(False)
        net[3].bias.requires_grad_(False)
    params = {n: p.detach() for n, p in net.named_parameters()}
    layers, _ = candidate_layers(net, names)
    assert own_graph(layers) is not frozen
    before = snapshot(net)
    reference = layer_features(net, params, layers, x)
    core = NetworkCore(net, names=names)
    own = core.features(x, layers)
    assert_unchanged(net, before)
    assert all(p.grad is None for p in net.parameters())
    # two code paths to the same float64 features: the same operations, whose order may differ (a few ε per layer
    # of this depth-4 network, ~1e-15 relative); 1e-12 as for the Jacobian blocks below
    for layer in layers:
        assert rel_err(own.inputs[layer.name], reference.inputs[layer.name]) < 1e-12
        assert rel_err(own.grads[layer.name], reference.grads[layer.name]) < 1e-12
        for name, block in layer.jacobians(own.inputs[layer.name], own.grads[layer.name]).items():
            assert rel_err(block, jacobians[name]) < 1e-12, name
    if not frozen:
        plain = layer_features(net, None, layers, x)
        assert rel_err(plain.outputs, reference.outputs) < 1e-12  # the module's own parameters: another path
        for layer in layers:
            assert rel_err(plain.grads[layer.name], reference.grads[layer.name]) < 1e-12
