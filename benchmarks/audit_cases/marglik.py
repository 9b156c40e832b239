"""Audit cases of ``ntkgp.training.train_marglik``: inputs, the user's state, interrupts and the evidence.

The network is trained in place (its purpose); everything else of the user's (``.grad`` objects and values,
``requires_grad``, train/eval modes, hooks, the tensors passed) must be as before. After an interrupt the
network and the hyperparameters must form the best checkpoint so far — checked by rebuilding the evidence at
the state left behind and comparing it with the checkpoint's recorded evidence — or the initial state.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader, TensorDataset

from ntkgp.training import train_marglik

from .framework import (CLEAR, HELD, Refused, SilentWrong, attempt, case, close, expect_interrupt,
                        refusal, same, untouched)
from .references import F64, gaussian, log_evidence, mlp, regression

AREA = "marglik"
OPTIONS = {"epochs": 6, "lr": 1e-2, "burn_in": 0, "frequency": 2, "hyper_steps": 5, "progress": False}


def _setup(dtype=F64):
    x, y = regression(20, dtype=dtype)
    return mlp(dtype=dtype), x, y, gaussian(0.1, dtype)


def _state(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _run(net, x, y, lik, **kwargs):
    return train_marglik(net, x, y, lik, **{**OPTIONS, **kwargs})


def _check_best_checkpoint(result, net, x, y, lik, initial, initial_noise):
    """The state left behind is the best checkpoint (its evidence recomputed) or the initial state."""
    if result.best_epoch < 0 or not result.history:
        same(torch.cat([v.reshape(-1) for v in _state(net).values()]),
             torch.cat([v.reshape(-1) for v in initial.values()]), "weights (initial state expected)")
        close(lik.noise, initial_noise, 0.0, what="noise (initial expected)")
        return "initial state"
    recomputed = result.model(x, y).log_marginal_likelihood().item() / x.shape[0]
    close(recomputed, result.log_evidence, 1e-8, what="evidence of the state left vs the best checkpoint's")
    best = next(r for r in result.history if r["epoch"] == result.best_epoch)
    close(lik.noise.reshape(-1), torch.tensor(best["noise"], dtype=F64), 1e-12,
          what="noise of the best checkpoint")
    return f"best checkpoint (epoch {result.best_epoch})"


class _Counting(torch.optim.Adam):
    """Adam that records how many forward calls of the network had happened at each step."""

    log: list[int] = []
    counter = None

    def step(self, closure=None):
        type(self).log.append(type(self).counter.calls)
        return super().step(closure)


class _CountCalls:
    def __init__(self, net):
        self.calls = 0
        self.handle = net.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1


class _RaiseAt:
    def __init__(self, net, at, error):
        self.calls, self.at, self.error = 0, at, error
        self.handle = net.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1
        if self.calls == self.at:
            raise self.error


def _step_calls() -> list[int]:
    """For each MAP step of an uninterrupted run, the number of network calls made up to its forward pass."""
    net, x, y, lik = _setup()
    counter = _CountCalls(net)
    _Counting.log, _Counting.counter = [], counter
    _run(net, x, y, lik, optimizer=_Counting)
    counter.handle.remove()
    return list(_Counting.log)


def _round_call(step: int) -> int:
    """The index of a network call in the hyperparameter round after MAP step ``step`` (frequency 2)."""
    calls = _step_calls()
    if calls[step] - calls[step - 1] < 3:
        raise RuntimeError("the audit's call count found no network call in the round")
    return calls[step - 1] + 2  # the step's own forward was the call before; +1 is the round's first


@case("marglik-01", AREA, "KeyboardInterrupt from a forward hook inside the second hyperparameter round")
def interrupt_in_round():
    at = _round_call(4)
    net, x, y, lik = _setup()
    net[0].weight.grad = torch.full_like(net[0].weight, 3.0)
    initial, noise0 = _state(net), lik.noise.detach().clone()
    with untouched(state=False, net=net, likelihood=lik, train_x=x, train_y=y):
        hook = _RaiseAt(net, at, KeyboardInterrupt())
        try:
            interrupt = expect_interrupt(lambda: _run(net, x, y, lik))
        finally:
            hook.handle.remove()
    result = getattr(interrupt, "marglik_result", None)
    if result is None:
        raise SilentWrong("the KeyboardInterrupt carries no marglik_result")
    return HELD, _check_best_checkpoint(result, net, x, y, lik, initial, noise0)


class _InterruptingScheduler:
    def __init__(self, optimizer, at=5):
        self.epoch, self.at = 0, at

    def step(self, *args):
        self.epoch += 1
        if self.epoch == self.at:
            raise KeyboardInterrupt


@case("marglik-02", AREA, "KeyboardInterrupt from the scheduler's step at epoch 5")
def interrupt_in_scheduler():
    net, x, y, lik = _setup()
    initial, noise0 = _state(net), lik.noise.detach().clone()
    with untouched(state=False, net=net, likelihood=lik):
        interrupt = expect_interrupt(lambda: _run(net, x, y, lik, scheduler=_InterruptingScheduler))
    result = getattr(interrupt, "marglik_result", None)
    if result is None:
        raise SilentWrong("the KeyboardInterrupt carries no marglik_result")
    return HELD, _check_best_checkpoint(result, net, x, y, lik, initial, noise0)


@case("marglik-03", AREA, "RuntimeError from a forward hook in the MAP step of epoch 5")
def error_in_map_step():
    at = _step_calls()[4]  # the forward pass of the fifth MAP step
    net, x, y, lik = _setup()
    initial, noise0 = _state(net), lik.noise.detach().clone()
    with untouched(state=False, net=net, likelihood=lik):
        hook = _RaiseAt(net, at, RuntimeError("user hook failed"))
        try:
            expect_interrupt(lambda: _run(net, x, y, lik), RuntimeError)
        finally:
            hook.handle.remove()
    reference_net, _, _, reference_lik = _setup()
    reference = _run(reference_net, x, y, reference_lik, epochs=4)  # the rounds completed before the error
    if reference.best_epoch > 0:
        close(lik.noise, reference_lik.noise, 1e-12, what="noise against a run stopped after epoch 4")
        state = _state(net)
        for key, value in _state(reference_net).items():
            close(state[key], value, 1e-12, what=f"{key} against a run stopped after epoch 4")
    return HELD, "best checkpoint of the completed rounds"


@case("marglik-04", AREA, "int64 regression targets (against the run on the same float targets)")
def integer_targets():
    net, x, _, lik = _setup()
    y_int = torch.arange(20) % 3 - 1
    net_ref, lik_ref = copy.deepcopy(net), copy.deepcopy(lik)
    with untouched(train_y=y_int):
        outcome = attempt(lambda: _run(net, x, y_int, lik), names=("train_y",))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    reference = _run(net_ref, x, y_int.to(F64), lik_ref)
    close(outcome.log_evidence, reference.log_evidence, 1e-12, what="evidence")
    for (k, a), b in zip(net.state_dict().items(), net_ref.state_dict().values()):
        close(a, b, 1e-12, what=k)
    return HELD, "the same run"


@case("marglik-05", AREA, "train_x a non-contiguous view (against the contiguous copy)")
def noncontiguous_train_x():
    net, x, y, lik = _setup()
    wide = torch.cat([x, x], dim=1)
    view = wide[:, 1:]
    net_ref, lik_ref = copy.deepcopy(net), copy.deepcopy(lik)
    with untouched(train_x=wide):
        result = _run(net, view, y, lik)
    reference = _run(net_ref, x.clone(), y, lik_ref)
    close(result.log_evidence, reference.log_evidence, 1e-12, what="evidence")
    for (k, a), b in zip(net.state_dict().items(), net_ref.state_dict().values()):
        close(a, b, 1e-12, what=k)
    return HELD, "the same run"


@case("marglik-06", AREA, "train_y a numpy array")
def numpy_targets():
    net, x, y, lik = _setup()
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: _run(net, x, y.numpy(), lik), (TypeError,), names=("train_y",))


@case("marglik-07", AREA, "a frozen parameter (requires_grad False) and a network left in train mode")
def frozen_parameter_and_train_mode():
    net, x, y, lik = _setup()
    net[0].bias.requires_grad_(False)
    net.train()
    frozen = net[0].bias.detach().clone()
    with untouched(state=False, net=net, likelihood=lik):
        result = _run(net, x, y, lik)
    same(net[0].bias, frozen, "the frozen bias")
    if torch.equal(net[2].weight, mlp()[2].weight):
        raise SilentWrong("the trainable weights did not move")
    if not all(torch.isfinite(torch.as_tensor(result.log_evidence)).reshape(-1)):
        raise SilentWrong("non-finite evidence")
    return HELD, "frozen bias unchanged, flags and modes kept"


@case("marglik-08", AREA, "the user's prior_precision tensor: not written, not aliased by the result")
def prior_precision_tensor():
    net, x, y, lik = _setup()
    delta = torch.tensor([2.0, 0.5], dtype=F64)
    with untouched(prior_precision=delta):
        result = _run(net, x, y, lik, prior_precision=delta)
    learned = result.prior_precision.detach().clone()
    delta.mul_(10.0)
    same(result.prior_precision.detach(), learned, "the result's prior precision after the user's write")
    return HELD, "copied"


@case("marglik-09", AREA, "epochs=True")
def bool_epochs():
    net, x, y, lik = _setup()
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: _run(net, x, y, lik, epochs=True), names=("epochs",))


@case("marglik-10", AREA, "hyper_lr=nan")
def nan_hyper_lr():
    net, x, y, lik = _setup()
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: _run(net, x, y, lik, hyper_lr=float("nan")), names=("hyper_lr",))


@case("marglik-11", AREA, "a DataLoader whose last batch holds an Inf input")
def inf_in_last_loader_batch():
    net, x, y, lik = _setup()
    x_bad = x.clone()
    x_bad[-1, 0] = float("inf")
    loader = DataLoader(TensorDataset(x_bad, y), batch_size=8)
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: _run(net, loader, None, lik), names=("train_x",))


@case("marglik-12", AREA, "a float32 likelihood with a float64 network")
def float32_likelihood():
    net, x, y, _ = _setup()
    lik = gaussian(0.1, torch.float32)
    net_ref, lik_ref = copy.deepcopy(net), gaussian(0.1)
    with untouched(state=False, net=net):
        outcome = attempt(lambda: _run(net, x, y, lik), names=("likelihood", "dtype"))
    if isinstance(outcome, Refused):
        return CLEAR, str(outcome)
    reference = _run(net_ref, x, y, lik_ref)
    close(outcome.log_evidence, reference.log_evidence, 1e-5, what="evidence against a float64 likelihood")
    return HELD, "agrees with the float64 likelihood's run"


@case("marglik-13", AREA, "result.log_evidence against a brute-force Laplace evidence (one δ)")
def evidence_brute_force():
    net, x, y, lik = _setup()
    result = _run(net, x, y, lik, prior_structure="network")
    delta = result.prior_precision.reshape(-1)[0].item()
    brute = log_evidence(net, x, y, delta, lik.noise.item()) / x.shape[0]
    close(result.log_evidence, brute, 1e-8, what="evidence / N against the dense formula")
    return HELD, f"log q(D)/N = {result.log_evidence:.4f}"


@case("marglik-14", AREA, "KeyboardInterrupt in the very first MAP step (before any round)")
def interrupt_first_step():
    net, x, y, lik = _setup()
    net[2].weight.grad = torch.zeros_like(net[2].weight)
    initial, noise0 = _state(net), lik.noise.detach().clone()
    with untouched(state=False, net=net, likelihood=lik):
        hook = _RaiseAt(net, 1, KeyboardInterrupt())
        try:
            expect_interrupt(lambda: _run(net, x, y, lik))
        finally:
            hook.handle.remove()
    for key, value in initial.items():
        same(net.state_dict()[key], value, f"{key} (initial expected)")
    close(lik.noise, noise0, 0.0, what="noise (initial expected)")
    return HELD, "initial state"


@case("marglik-15", AREA, "a DataLoader of numpy batches (structure='kfac')")
def numpy_loader():
    net, x, y, lik = _setup()
    batches = [(x[:10].numpy(), y[:10].numpy()), (x[10:].numpy(), y[10:].numpy())]
    with untouched(net=net, likelihood=lik):
        return refusal(lambda: _run(net, batches, None, lik, structure="kfac"), (TypeError,),
                       names=("train_x",))


@case("marglik-16", AREA, "epochs=np.int64(6), batch_size=np.int64(10) (numpy integers) against Python ints")
def numpy_counts():
    import numpy as np

    net, x, y, lik = _setup()
    net_ref, lik_ref = copy.deepcopy(net), copy.deepcopy(lik)
    try:
        result = _run(net, x, y, lik, epochs=np.int64(6), batch_size=np.int64(10))
    except (TypeError, ValueError) as error:
        raise RuntimeError(f"valid integer counts refused: {type(error).__name__}: {error}") from error
    reference = _run(net_ref, x, y, lik_ref, epochs=6, batch_size=10)
    close(result.log_evidence, reference.log_evidence, 0.0, what="evidence")
    for (k, a), b in zip(net.state_dict().items(), net_ref.state_dict().values()):
        close(a, b, 0.0, what=k)
    return HELD, "the same run"


@case("marglik-17", AREA, "KeyboardInterrupt from the likelihood (a read of its noise) half-way through training")
def interrupt_in_likelihood():
    from .references import InterruptingGaussian, interrupting_gaussian

    net, x, y, _ = _setup()
    lik = interrupting_gaussian(0.1)
    InterruptingGaussian.arm(10**9)  # a dry run: how often the noise is read
    try:
        _run(copy.deepcopy(net), x, y, lik)
    finally:
        reads = InterruptingGaussian.disarm()
    lik = interrupting_gaussian(0.1)
    initial, noise0 = _state(net), lik.noise.detach().clone()
    with untouched(state=False, net=net, likelihood=lik, train_x=x, train_y=y):
        InterruptingGaussian.arm(reads // 2)
        try:
            interrupt = expect_interrupt(lambda: _run(net, x, y, lik))
        finally:
            InterruptingGaussian.disarm()
    result = getattr(interrupt, "marglik_result", None)
    if result is None:
        raise SilentWrong("the KeyboardInterrupt carries no marglik_result")
    return HELD, _check_best_checkpoint(result, net, x, y, lik, initial, noise0) + f" (read {reads // 2} of {reads})"
