"""What train_marglik leaves behind: the parameters' ``.grad`` exactly as the user left them (success, an
error, an interrupt), and after an interrupt (``KeyboardInterrupt`` in a MAP step or inside a hyperparameter
round, a real SIGINT, or any other exception) the best checkpoint so far with its hyperparameters — checked
against a fresh, uninterrupted run that stops at the last completed round, and against a saved copy of the
initial weights before any round."""

import copy
import dataclasses
import signal

import pytest
import torch

from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik

# rounds after epochs 4, 8, 12, ... (B = 0, F = 4), K = 3 steps each; one full-batch MAP step per epoch
SETTINGS = dict(lr=1e-2,
                schedule=HyperparameterSchedule(burn_in=0, frequency=4, hyper_steps=3, hyper_lr=0.1),
                progress=False)


def _user_grads(net, lik):
    """Give some parameters a ``.grad`` (others keep ``None``); return ``[(param, grad object, saved copy)]``."""
    params = [*net.parameters(), *lik.parameters()]
    g = torch.Generator().manual_seed(5)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g) if i % 2 == 0 else None
    return [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in params]


def _assert_grads_as_before(saved):
    for p, grad, copy_ in saved:
        assert p.grad is grad  # the same object (or None)
        if copy_ is not None:
            assert torch.equal(p.grad, copy_)


def _assert_same_state(net, reference):
    state = net.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)


@pytest.mark.parametrize("structure", ["full_ggn", "kfac"])
def test_grads_are_left_as_the_user_left_them(small_regression, structure):
    x, y, net, lik = small_regression()
    saved = _user_grads(net, lik)
    train_marglik(net, x, y, lik, structure=structure, epochs=8, **SETTINGS)
    _assert_grads_as_before(saved)


def test_grads_are_left_as_before_when_training_raises(small_regression):
    x, y, net, lik = small_regression()
    saved = _user_grads(net, lik)
    before = copy.deepcopy(net.state_dict())

    class Diverging(torch.optim.SGD):  # a step that leaves a non-finite weight: the MAP training diverged
        def step(self, closure=None):
            loss = super().step(closure)
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
            return loss

    with pytest.raises(FloatingPointError):  # before any round: the initial weights are restored
        train_marglik(net, x, y, lik, epochs=8, optimization=MAPOptimization(optimizer=Diverging), **SETTINGS)
    _assert_grads_as_before(saved)
    _assert_same_state(net, before)


def _interrupting_optimizer(at_step, action):
    """Adam whose ``at_step``-th step (1-based, over the whole run) calls ``action`` first."""

    class Interrupting(torch.optim.Adam):
        steps = 0

        def step(self, closure=None):
            type(self).steps += 1
            if type(self).steps == at_step:
                action()
            return super().step(closure)

    return Interrupting


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


def _raise_sigint():
    signal.raise_signal(signal.SIGINT)  # the default handler raises KeyboardInterrupt in the main thread


def _raise_runtime_error():
    raise RuntimeError("a failing callback")


ACTIONS = {"keyboard_interrupt": _raise_keyboard_interrupt, "sigint": _raise_sigint, "error": _raise_runtime_error}
RAISED = {"keyboard_interrupt": KeyboardInterrupt, "sigint": KeyboardInterrupt, "error": RuntimeError}


@pytest.fixture
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupted_run(small_regression, where, how, at):
    """Train for 20 epochs, interrupted at MAP step ``at`` (``where="map"``) or at hyperparameter step ``at``
    (``where="round"``, from a gradient hook on the likelihood's noise, which only the rounds differentiate)."""
    x, y, net, lik = small_regression()
    saved = _user_grads(net, lik)
    optimizer = torch.optim.Adam
    if where == "map":
        optimizer = _interrupting_optimizer(at, ACTIONS[how])
    else:
        calls = []

        def hook(grad):
            calls.append(1)
            if len(calls) == at:
                ACTIONS[how]()

        lik.raw_noise.register_hook(hook)
    with pytest.raises(RAISED[how]) as caught:
        train_marglik(net, x, y, lik, epochs=20, optimization=MAPOptimization(optimizer=optimizer),
                      **SETTINGS)
    _assert_grads_as_before(saved)
    return x, y, net, lik, caught.value


@pytest.mark.usefixtures("default_sigint")
@pytest.mark.parametrize("how", ["keyboard_interrupt", "sigint", "error"])
@pytest.mark.parametrize(("where", "at", "completed"), [("map", 10, 8), ("round", 5, 4)])
def test_an_interrupt_leaves_the_best_checkpoint_with_its_hyperparameters(small_regression, where, at, completed,
                                                                          how):
    """MAP step 10 is in epoch 10 (rounds after epochs 4 and 8 done); hyperparameter step 5 is the second of
    the round after epoch 8 (only the round after epoch 4 done). A fresh run of ``completed`` epochs does the
    same completed rounds and ends at the same best checkpoint."""
    x, y, net, lik, error = _interrupted_run(small_regression, where, how, at)
    x, y, ref_net, ref_lik = small_regression()
    reference = train_marglik(ref_net, x, y, ref_lik, epochs=completed, **SETTINGS)
    _assert_same_state(net, ref_net.state_dict())
    assert torch.equal(lik.noise, ref_lik.noise)
    if how == "error":
        return
    result = error.marglik_result
    assert result.best_epoch == reference.best_epoch and result.log_evidence == reference.log_evidence
    assert torch.equal(result.prior_precision, reference.prior_precision)
    assert [h["epoch"] for h in result.history] == [h["epoch"] for h in reference.history]
    # network, δ and σ² belong together: the evidence of a fresh NTKGP at them is the recorded one
    assert abs(result.model(x, y).log_marginal_likelihood().item() / x.shape[0] - result.log_evidence) < 1e-9


@pytest.mark.usefixtures("default_sigint")
@pytest.mark.parametrize("how", ["keyboard_interrupt", "sigint"])
def test_an_interrupt_before_any_round_restores_the_initial_weights_and_hyperparameters(small_regression, how):
    x, y, net, lik = small_regression()
    initial, noise = copy.deepcopy(net.state_dict()), lik.noise.detach().clone()
    saved = _user_grads(net, lik)
    with pytest.raises(KeyboardInterrupt) as caught:
        train_marglik(net, x, y, lik, epochs=20,
                      optimization=MAPOptimization(optimizer=_interrupting_optimizer(3, ACTIONS[how])),
                      **SETTINGS)
    _assert_same_state(net, initial)
    assert torch.equal(lik.noise, noise)
    _assert_grads_as_before(saved)
    assert caught.value.marglik_result.best_epoch == -1 and caught.value.marglik_result.history == []


def test_an_interrupt_with_a_loader_and_minibatches(small_regression):
    """The same guarantee with a DataLoader of mini-batches (three steps per epoch): interrupted in epoch 6,
    the network holds the round of epoch 4, as a fresh run of 4 epochs on an identically seeded loader."""

    def loader(x, y):
        dataset = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(dataset, batch_size=12, shuffle=True,
                                           generator=torch.Generator().manual_seed(3))

    x, y, net, lik = small_regression()
    with pytest.raises(KeyboardInterrupt):
        train_marglik(net, loader(x, y), None, lik, epochs=20,
                      optimization=MAPOptimization(optimizer=_interrupting_optimizer(17, _raise_keyboard_interrupt)),
                      **SETTINGS)
    _, _, ref_net, ref_lik = small_regression()
    train_marglik(ref_net, loader(x, y), None, ref_lik, epochs=4, **SETTINGS)
    _assert_same_state(net, ref_net.state_dict())
    assert torch.equal(lik.noise, ref_lik.noise)


def test_learn_likelihood_false_leaves_the_likelihood_alone_after_an_interrupt(small_regression):
    x, y, net, lik = small_regression()
    raw = lik.raw_noise.detach().clone()
    with pytest.raises(KeyboardInterrupt):
        train_marglik(net, x, y, lik, epochs=20,
                      optimization=MAPOptimization(optimizer=_interrupting_optimizer(10, _raise_keyboard_interrupt)),
                      **{**SETTINGS, "schedule": dataclasses.replace(SETTINGS["schedule"], learn_likelihood=False)})
    assert torch.equal(lik.raw_noise, raw)


@pytest.mark.parametrize("mode", [False, True])
@pytest.mark.parametrize("structure", ["full_ggn", "kfac"])
def test_the_likelihoods_train_eval_modes_are_kept(small_regression, structure, mode):
    """train_marglik built an NTKGP holding the likelihood and called ``model.train()``, which switched a
    likelihood the user had put in eval mode (and its submodules) to training mode."""
    x, y, net, lik = small_regression()
    lik.train(mode)
    net_modes = [m.training for m in net.modules()]
    train_marglik(net, x, y, lik, structure=structure, epochs=4, **SETTINGS)
    assert [m.training for m in lik.modules()] == [mode] * len(list(lik.modules()))
    assert [m.training for m in net.modules()] == net_modes
