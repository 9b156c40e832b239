"""ntkgp's private structural copy of the network (ntkgp.ntk.private_copy, issue 38 item 3): the user's module is
never touched, not even for the length of a call, and concurrent reads of one model from several threads give the
one-thread numbers while the user's own forward runs beside them."""

import copy
import pickle
import threading

import gpytorch
import torch
from torch import nn

import ntkgp
from ntkgp.ntk import NetworkCore, NTKEngine
from ntkgp.ntk.private_copy import PrivateCopies, differentiable_kernels, signature, structural_copy
from tests.helpers import assert_unchanged, brute_jacobian, rel_err, snapshot


def net_with_user_hook():
    """An MLP whose first layer carries the user's own forward pre-hook, which records what it sees."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double().eval()
    seen = []

    def hook(module, args):
        # the user's module itself, as another thread would see it while ntkgp's pass runs
        seen.append((type(net[0].weight), len(net[0]._forward_hooks), module is net[0]))

    net[0].register_forward_pre_hook(hook)
    return net, seen


def test_the_users_module_is_never_touched_during_a_pass():
    net, seen = net_with_user_hook()
    before = snapshot(net)
    x = torch.randn(5, 3, dtype=torch.float64)
    engine = NTKEngine(net)
    engine.group_grams(x)  # layer features: ntkgp's hooks and functional_call
    engine.jacobian(x)  # vmap(jacrev)
    engine.jvp(x, engine.core.unflatten(torch.randn(engine.num_params, dtype=torch.float64)))  # forward mode
    engine.vjp(x, torch.randn(10, dtype=torch.float64))
    calls_by_ntkgp = len(seen)
    assert calls_by_ntkgp > 0  # the user's hook ran (on ntkgp's copy: the user's hooks are carried over)
    assert all(kind is nn.Parameter for kind, _, _ in seen)  # never a swapped plain tensor
    assert all(hooks == 0 for _, hooks, _ in seen)  # never ntkgp's hooks on the user's module
    assert not any(own for _, _, own in seen)  # called with ntkgp's copy of the module, not the user's
    assert_unchanged(net, before)
    net(x)  # the user's own call: the user's module
    assert seen[-1] == (nn.Parameter, 0, True)


def test_the_copy_shares_the_tensors_and_keeps_ties_and_sharing():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    twice = structural_copy(nn.Sequential(shared, nn.Tanh(), shared))
    assert twice[0] is twice[2] and twice[0] is not shared  # a module used twice is copied once
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double().eval()
    net[4].weight = net[2].weight  # a tied weight in another module
    mine = structural_copy(net)
    assert mine is not net and mine[4].weight is mine[2].weight  # own objects, still tied
    for (n1, p1), (n2, p2) in zip(net.named_parameters(), mine.named_parameters()):
        assert n1 == n2 and p1 is p2  # the user's tensors, not copies
    assert mine[0]._forward_hooks is not net[0]._forward_hooks and mine._modules is not net._modules
    x = torch.randn(4, 3, dtype=torch.float64)
    j, _ = brute_jacobian(net, x)
    assert rel_err(NTKEngine(net).jacobian(x), j) < 1e-12


def test_a_recurrent_layers_flat_weights_are_left_as_they_are():
    """``RNNBase.__setattr__`` rewrites ``_flat_weights`` in place when functional_call swaps a weight: on ntkgp's
    copy it rewrites the copy's list."""
    torch.manual_seed(0)
    gru = nn.GRU(2, 3, batch_first=True).double()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = gru, nn.Linear(3, 1)

        def forward(self, x):
            return self.head(self.rnn(x.reshape(x.shape[0], 2, 2))[0][:, -1])

    net = Net().double().eval()
    flat = list(gru._flat_weights)
    x = torch.randn(3, 4, dtype=torch.float64)
    NTKEngine(net).group_grams(x)
    ntkgp.NTKGP(net, x, torch.randn(3, dtype=torch.float64), gpytorch.likelihoods.GaussianLikelihood().double())
    assert all(a is b and type(a) is nn.Parameter for a, b in zip(gru._flat_weights, flat))


def test_a_change_of_structure_rebuilds_the_copy():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    copies = PrivateCopies(net)
    first = copies.get()
    assert copies.get() is first  # nothing changed: the same copy
    with torch.no_grad():
        net[0].weight.mul_(2.0)  # an in-place change of a weight is seen through the shared tensor
    assert copies.get() is first and torch.equal(first[0].weight, net[0].weight)
    net[2] = nn.Linear(4, 2).double()  # a replaced module: a new copy, with the new module's tensors
    second = copies.get()
    assert second is not first and second[2].weight is net[2].weight
    net[1].some_flag = 3  # a plain attribute
    third = copies.get()
    assert third is not second and third[1].some_flag == 3
    sig = signature(net)
    net.train()
    assert signature(net) != sig  # training flags are part of it
    net.eval()
    # and the results follow the new network (an engine built before the change)
    x = torch.randn(4, 3, dtype=torch.float64)
    engine = NTKEngine(net, prior_structure="network")
    engine.group_grams(x)
    net[2] = nn.Linear(4, 2).double()
    j, _ = brute_jacobian(net, x)
    assert rel_err(engine.group_grams(x)[0], j @ j.T) < 1e-12


def test_a_parametrized_network_and_pickles():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    nn.utils.parametrize.register_parametrization(net[0], "weight", Symmetric())
    x = torch.randn(5, 3, dtype=torch.float64)
    j, _ = brute_jacobian(net, x)
    engine = NTKEngine(net)
    assert rel_err(engine.jacobian(x), j) < 1e-12
    # the copies pickle and deep-copy (a plain network: torch refuses to pickle parametrized ones) without the
    # copies themselves, each rebuilt on first use
    core = NetworkCore(nn.Sequential(nn.Linear(3, 2)).double())
    for clone in (pickle.loads(pickle.dumps(core._copies)), copy.deepcopy(core._copies)):
        assert isinstance(clone, PrivateCopies) and clone.get() is not core.module()


class Symmetric(nn.Module):
    def forward(self, w):  # a (4, 3) weight from its upper rows: a parametrization of the user's own
        return torch.cat([w[:3].triu() + w[:3].triu(1).T, w[3:]])


def test_the_differentiable_kernels_are_restored_after_nested_and_concurrent_use():
    fast = torch.backends.mha.get_fastpath_enabled()
    flash = torch.backends.cuda.flash_sdp_enabled()
    done = threading.Event()

    def other():
        with differentiable_kernels():
            done.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    with differentiable_kernels():
        with differentiable_kernels():
            assert not torch.backends.mha.get_fastpath_enabled()
        assert not torch.backends.mha.get_fastpath_enabled()
    assert not torch.backends.mha.get_fastpath_enabled()  # the other thread is still inside
    done.set()
    thread.join()
    assert torch.backends.mha.get_fastpath_enabled() == fast and torch.backends.cuda.flash_sdp_enabled() == flash


def _read(name, model, x):
    if name == "NTKKernel":
        return model(x).to_dense().reshape(-1)
    dist = model(x)
    return torch.cat([dist.mean.reshape(-1), dist.variance.reshape(-1)])


def test_several_threads_and_the_users_own_forward():
    """Three threads per model (NTKGP, SFR, FSVI, NTKKernel on one network) and the user's ``net(x)`` in a loop:
    every result equals the one-thread number and the user always sees its own ``nn.Parameter``\\ s."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2)).double().eval()
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)

    def lik():
        return gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2).double()

    models = {
        "NTKGP": ntkgp.NTKGP(net, x, y, lik()).eval(),
        "SFR": ntkgp.SFR(net, x, y, lik(), num_inducing=8).eval(),
        "FSVI": ntkgp.FSVI(net, lik()).eval(),
        "NTKKernel": ntkgp.NTKKernel(net),
    }
    tests = [torch.randn(5, 3, dtype=torch.float64) for _ in range(4)]
    with torch.no_grad():
        reference = {name: [_read(name, m, t) for t in tests] for name, m in models.items()}
    for m in models.values():
        if hasattr(m, "clear_cache"):
            m.clear_cache()
    problems, stop = [], threading.Event()

    def user():
        while not stop.is_set():
            try:
                net(tests[0])
                if type(net[0].weight) is not nn.Parameter or net[0]._forward_hooks:
                    problems.append("the user saw a swapped parameter or ntkgp's hook")
            except Exception as error:  # noqa: BLE001 - reported by the assertion below
                problems.append(f"user: {error!r}")
                return

    def reader(name, model):
        try:
            with torch.no_grad():
                for _ in range(2):
                    for t, ref in zip(tests, reference[name]):
                        # float64; the same computation in the same order, but torch's kernels may split sums by
                        # the threads available: a few ulps, far below 1e-10
                        if not torch.allclose(_read(name, model, t), ref, rtol=1e-10, atol=1e-12):
                            problems.append(f"{name}: not the one-thread numbers")
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            problems.append(f"{name}: {error!r}")

    threads = [threading.Thread(target=reader, args=item) for item in models.items() for _ in range(3)]
    watcher = threading.Thread(target=user)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    watcher.join()
    assert not problems, problems[:5]
