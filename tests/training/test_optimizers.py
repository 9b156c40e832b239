"""The MAP optimizer and learning-rate scheduler of train_marglik: a closure-based optimizer (LBFGS) is stepped
with a closure, a learning-rate schedule is applied per epoch — both against hand-written training loops on the
MAP objective written out with torch.distributions — and bad factories are refused before any side effect."""

import copy
import functools

import pytest
import torch

from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik

# no hyperparameter learning (K = 0) and one round after the last epoch: the weights are the MAP loop's
FIXED = dict(schedule=HyperparameterSchedule(burn_in=100, frequency=100, hyper_steps=0), progress=False)


def test_lbfgs_is_stepped_with_a_closure_as_a_hand_written_loop(small_regression, map_loss):
    x, y, net, lik = small_regression()
    reference = copy.deepcopy(net)
    noise = lik.noise.detach().clone()
    evaluations = []

    class CountingLBFGS(torch.optim.LBFGS):
        def step(self, closure):
            def counted():
                evaluations.append(1)
                return closure()

            return super().step(counted)

    result = train_marglik(net, x, y, lik, epochs=3, lr=0.5,
                           optimization=MAPOptimization(optimizer=CountingLBFGS), **FIXED)
    assert len(evaluations) > 3  # LBFGS re-evaluated the loss within its steps
    opt = torch.optim.LBFGS(reference.parameters(), lr=0.5)

    def closure():
        opt.zero_grad()
        loss = map_loss(reference, x, y, noise, 1.0, x.shape[0])
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(3)]
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
    assert result.train_loss == pytest.approx(losses, rel=1e-9)
    assert all(p.grad is None for p in [*net.parameters(), *lik.parameters()])


def test_lbfgs_learns_the_hyperparameters(small_regression):
    x, y, net, lik = small_regression()
    result = train_marglik(net, x, y, lik, epochs=6, lr=0.5,
                           optimization=MAPOptimization(optimizer=torch.optim.LBFGS),
                           schedule=HyperparameterSchedule(burn_in=0, frequency=3, hyper_steps=10),
                           progress=False)
    assert [h["epoch"] for h in result.history] == [3, 6]
    # the loaded checkpoint: a fresh NTKGP's evidence at the learned hyperparameters is the reported one
    assert abs(result.model(x, y).log_marginal_likelihood().item() / x.shape[0] - result.log_evidence) < 1e-9


def test_a_multistep_schedule_is_applied_per_epoch(small_regression, map_loss):
    """MultiStepLR(milestones=[2, 4], gamma=0.1) with SGD: lr for epochs 1-2, lr/10 for 3-4, lr/100 after."""
    x, y, net, lik = small_regression()
    reference = copy.deepcopy(net)
    noise = lik.noise.detach().clone()
    schedule = functools.partial(torch.optim.lr_scheduler.MultiStepLR, milestones=[2, 4], gamma=0.1)
    train_marglik(net, x, y, lik, epochs=6, lr=0.3,
                  optimization=MAPOptimization(optimizer=torch.optim.SGD, scheduler=schedule), **FIXED)
    for epoch in range(1, 7):
        step = 0.3 * (1.0 if epoch <= 2 else 0.1 if epoch <= 4 else 0.01)
        grads = torch.autograd.grad(map_loss(reference, x, y, noise, 1.0, x.shape[0]), list(reference.parameters()))
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p -= step * g
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    # without the schedule the weights differ: the schedule did something
    _, _, plain, plain_lik = small_regression()
    train_marglik(plain, x, y, plain_lik, epochs=6, lr=0.3,
                  optimization=MAPOptimization(optimizer=torch.optim.SGD), **FIXED)
    assert not torch.allclose(next(plain.parameters()), next(net.parameters()))


def test_reduce_on_plateau_is_given_the_epoch_loss(small_regression):
    x, y, net, lik = small_regression()
    seen = []

    class Recording(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def step(self, metrics):
            seen.append(metrics)
            return super().step(metrics)

    result = train_marglik(net, x, y, lik, epochs=4, lr=1e-2,
                           optimization=MAPOptimization(scheduler=Recording), **FIXED)
    assert seen == result.train_loss


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optimizer": lambda params, lr: object()}, TypeError, "optimizer must give a torch.optim.Optimizer"),
        ({"optimizer": functools.partial(torch.optim.SGD, momentum=-1.0)}, ValueError, "optimizer: SGD"),
        ({"optimizer": torch.optim.Adam(torch.nn.Linear(1, 1).parameters())}, TypeError, "optimizer"),
        ({"scheduler": "multistep"}, TypeError, "scheduler"),
        ({"scheduler": lambda opt: object()}, TypeError, "scheduler must give"),
        ({"scheduler": torch.optim.lr_scheduler.MultiStepLR}, TypeError, "scheduler: MultiStepLR"),
    ],
)
def test_bad_optimizers_and_schedulers_are_refused_before_any_side_effect(small_regression, kwargs, error, match):
    x, y, net, lik = small_regression()
    before = copy.deepcopy(net.state_dict())
    raw = lik.raw_noise.detach().clone()
    with pytest.raises(error, match=match):
        train_marglik(net, x, y, lik, epochs=2, progress=False, optimization=MAPOptimization(**kwargs))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert torch.equal(lik.raw_noise, raw)
    assert all(p.grad is None for p in [*net.parameters(), *lik.parameters()])
