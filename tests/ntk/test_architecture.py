"""The layer plan and the fit check kept across the cores built on one network (ntkgp.ntk.architecture): run once
per architecture, again after any change of it, and each result against an independent computation (the
uncached plan, autograd, the convolution's own output shape, a dense KFAC block)."""

import gc
import types
import weakref
from unittest import mock

import gpytorch
import pytest
import torch
from torch import nn

from ntkgp.laplace.weight_space import compute_curvature
from ntkgp.ntk import NetworkCore, layer_plan
from ntkgp.ntk import network as network_module
from tests.helpers import assert_unchanged, mlp, rel_err, snapshot


def counted():
    """A patch that counts the layer checks against autograd (the work the cache saves)."""
    return mock.patch.object(layer_plan, "verify_layers", wraps=layer_plan.verify_layers)


def plan_of(net, x, **kwargs):
    core = NetworkCore(net, **kwargs)
    return core.layer_plan(core.prepare(x))


class Tied(nn.Module):
    """Two linear layers; with ``tied`` the first one's weight is also used outside its forward (a plain
    attribute, the kind of change that leaves every module and parameter as it was)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)
        self.tied = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.tied:
            h = h + x @ self.a.weight.T
        return self.b(h)


def test_one_check_per_architecture_whatever_the_number_of_cores_and_builds():
    net = mlp(d_in=3, width=5, d_out=1)
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    with counted() as verify:
        plans = [plan_of(net, x) for _ in range(3)]
        values = [compute_curvature(net, x, y, lik, "kfac").log_marginal_likelihood(1.0, lik) for _ in range(2)]
    assert verify.call_count == 1  # the KFAC modules' plan is the plan of every layer, restricted
    fresh = layer_plan.plan_layers(net, {n: p.detach() for n, p in net.named_parameters()},
                                   [n for n, _ in net.named_parameters()], x[:1])
    for plan in plans:
        assert plan.routes() == fresh.routes() and plan.locations == fresh.locations and not plan.problems
        assert all(a.module is b.module for a, b in zip(plan.layers, fresh.layers))
    assert torch.equal(values[0], values[1])


def test_a_plain_attribute_that_ties_a_weight_is_seen():
    net = Tied().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    assert plan_of(net, x).names == ("a", "b")
    net.tied = True  # now the weight of a is used outside a's forward: the check against autograd must run again
    with counted() as verify:
        plan = plan_of(net, x)
    assert verify.call_count == 1 and plan.names == ("b",) and isinstance(plan.problems["a"], ValueError)
    with pytest.raises(ValueError, match="KFAC"):
        compute_curvature(net, x, torch.randn(4, dtype=torch.float64),
                          gpytorch.likelihoods.GaussianLikelihood().double(), "kfac")
    net.tied = False
    assert plan_of(net, x).names == ("a", "b")


class Shared(nn.Module):
    """A conv layer, a layer whose weight is also used outside its forward, one whose weight is shared, and a
    head: every kind of verdict."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.tied, self.head = nn.Linear(8, 4), nn.Linear(4, 1)
        self.twin = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)
        self.other.weight = self.twin.weight

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        h = torch.tanh(self.tied(h)) + h[:, :4] @ self.tied.weight[:, :4].T
        return self.head(self.other(self.twin(h)))


@pytest.mark.parametrize("modules", [None, ["conv"], ["head", "tied"], ["twin", "conv", "head"], ["other"]])
def test_the_plan_of_some_modules_is_the_uncached_one(modules):
    torch.manual_seed(0)
    net = Shared().double()
    x = torch.randn(3, 1, 4, 4, dtype=torch.float64)
    core = NetworkCore(net)
    x = core.prepare(x)
    plan_of(net, x)  # every layer verified once
    with counted() as verify:
        plan = core.layer_plan(x, modules)
    assert verify.call_count == 0
    fresh = layer_plan.plan_layers(net, core.functional_params(), core.names, x[:1], modules)
    assert plan.routes() == fresh.routes() and plan.locations == fresh.locations
    assert [(m, type(e), str(e)) for m, e in plan.problems.items()] == [
        (m, type(e), str(e)) for m, e in fresh.problems.items()]
    with pytest.raises(ValueError, match=r"modules \['nope'\] are not Linear/Conv2d layers"):
        NetworkCore(net).layer_plan(x, ["conv", "nope"])


def test_an_instance_forward_is_seen():
    net = Tied().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    assert plan_of(net, x).names == ("a", "b")
    # a forward bound to the instance: ntkgp's private copy of the network runs it bound to the copy
    net.forward = types.MethodType(lambda self, x: self.b(torch.tanh(self.a(x)) + x @ self.a.weight.T), net)
    assert plan_of(net, x).names == ("b",)
    del net.forward
    assert plan_of(net, x).names == ("a", "b")


def test_a_forward_that_bypasses_the_private_copy_is_refused_at_construction():
    """A closure over the user's network set as its forward reads the user's parameters, not those of ntkgp's
    private copy: its Jacobian would be silently zero, so the first input is refused, naming a parameter."""
    net = Tied().double()
    net.forward = lambda x: net.b(torch.tanh(net.a(x)))
    with pytest.raises(ValueError, match=r"uses the parameter 'a.weight' through a reference outside"):
        NetworkCore(net).prepare(torch.randn(4, 3, dtype=torch.float64))


def test_a_changed_stride_gives_the_new_number_of_locations():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, stride=1, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(2, 1)).double()
    x = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    assert plan_of(net, x).locations["0"] == 36
    net[0].stride, net[0].padding = (2, 2), (0, 0)  # the same modules and parameters, fewer locations
    with counted() as verify:
        plan = plan_of(net, x)
    t = net[0](x[:1]).shape[-2:].numel()  # the convolution's own output: 2 × 2
    assert verify.call_count == 1 and plan.locations["0"] == t == 4


def test_replaced_modules_and_parameters_hooks_flags_and_dtype_run_the_check_again():
    net = mlp(d_in=3, width=5, d_out=1)
    x = torch.randn(4, 3, dtype=torch.float64)
    plan_of(net, x)

    def replace_module():
        net[0] = nn.Linear(3, 5).double()  # the old one is freed: its address may be reused

    def replace_parameter():
        net[0].weight = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))

    handle = []
    changes = [replace_module, replace_parameter,
               lambda: handle.append(net[0].register_forward_hook(lambda *args: None)),
               lambda: handle.pop().remove(),
               lambda: net[2].bias.requires_grad_(False),
               lambda: net.float()]
    for change in changes:
        change()
        gc.collect()
        xs = x.to(next(net.parameters()).dtype)
        with counted() as verify:
            plan = plan_of(net, xs)
            again = plan_of(net, xs)
        assert verify.call_count == 1, change
        assert [layer.module for layer in plan.layers] == [m for m in net if isinstance(m, nn.Linear)]
        assert again.routes() == plan.routes()
    assert plan.layers[1].bias is None and plan.layers[2].bias == "4.bias"  # the frozen bias is out of θ


def test_the_fit_check_follows_a_changed_input_layer():
    net = mlp(d_in=3, width=5, d_out=1)
    x = torch.randn(4, 3, dtype=torch.float64)
    with mock.patch.object(network_module, "check_fits", wraps=network_module.check_fits) as fits:
        for _ in range(3):
            NetworkCore(net).prepare(x)
        assert fits.call_count == 1
    net[0] = nn.Linear(2, 5).double()
    with pytest.raises(ValueError, match="x of shape \\(4, 3\\).*does not fit the network"):
        NetworkCore(net).prepare(x)
    core = NetworkCore(net)
    core.prepare(x[:, :2])
    with pytest.raises(ValueError, match="train_x gives 2 network outputs, earlier inputs 1"):
        net[4] = nn.Linear(5, 2).double()  # same input width, another number of outputs, one core
        core._fits.clear()
        core.prepare(x[:, :2], "train_x")


def test_the_cache_holds_the_network_weakly():
    net = mlp(d_in=3, width=5, d_out=1)
    x = torch.randn(4, 3, dtype=torch.float64)
    plan_of(net, x)
    alive = weakref.ref(net)
    del net
    gc.collect()
    assert alive() is None


def test_a_forward_without_graph_equals_the_layers_by_hand_and_leaves_the_network():
    net = mlp(d_in=3, width=5, d_out=2)
    x = torch.randn(6, 3, dtype=torch.float64)
    core = NetworkCore(net)
    before = snapshot(net)
    with torch.no_grad():
        f = core.forward(x)
    h = x
    for module in net:  # Linear and Tanh by hand, from the weights
        h = h @ module.weight.detach().T + module.bias.detach() if isinstance(module, nn.Linear) else h.tanh()
    assert not f.requires_grad and rel_err(f, h) < 1e-14
    with torch.enable_grad():
        assert rel_err(core.forward(x).detach(), h) < 1e-14  # the functional route, with a graph
    assert_unchanged(net, before)


def test_dtype_and_device_follow_the_first_parameter():
    net = mlp(d_in=3, width=5, d_out=1)
    core = NetworkCore(net)
    assert core.dtype == torch.float64 and core.device == net[0].weight.device
    net.float()
    assert core.dtype == torch.float32


def test_a_core_for_one_pass_walks_the_modules_once_and_never_stores_under_a_stale_signature():
    """``fixed_architecture``: a KFAC build (its core's fit check, then its layer plan) walks the network's modules
    once when both results are known; a core whose network changed after its first look-up computes what it lacks
    under the new signature, which later cores find (the plan of the new modules, against the uncached one)."""
    from ntkgp.ntk import architecture

    net = mlp(d_in=3, width=5, d_out=1)
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    compute_curvature(net, x, y, lik, "kfac")
    with mock.patch.object(architecture, "Signature", wraps=architecture.Signature) as walks:
        compute_curvature(net, x, y, lik, "kfac")
    assert walks.call_count == 1
    net = mlp(d_in=3, width=5, d_out=1, seed=1)  # nothing cached yet
    core = NetworkCore(net, fixed_architecture=True)
    core.prepare(x)  # its first look-up: the fit check only
    net[0] = nn.Linear(3, 5).double()
    with counted() as verify:
        plan = core.layer_plan(x[:1])
        again = plan_of(net, x)
    assert verify.call_count == 1  # computed under the new signature, found there by the next core
    fresh = layer_plan.plan_layers(net, {n: p.detach() for n, p in net.named_parameters()},
                                   [n for n, _ in net.named_parameters()], x[:1])
    for p in (plan, again):
        assert [layer.module for layer in p.layers] == [layer.module for layer in fresh.layers]
        assert p.routes() == fresh.routes()
