"""Audit cases of issue 38 (the fourth round), part two: networks users write (a parameter the forward never uses,
tuple and dict outputs, an uninitialized ``LazyLinear``, ``nn.GRU``, a ``weight_norm`` parametrization, a
``TransformerEncoder``) — each gets a result equal to the dense GLM predictive (``torch.func.jacrev``) or a clear error
at construction, never an error at its first prediction — and threads: the user's network seen (and run) from another
thread during ntkgp calls, and two threads predicting with one model."""

from __future__ import annotations

import threading

import torch
from torch import nn

import ntkgp
from ntkgp.fsvi import FSVI

from .framework import (CLEAR, HELD, ModifiedUserObject, Refused, SilentWrong, attempt, case, close, refusal,
                        untouched)
from .references import F64, fit, gaussian, glm_predictive, mlp, regression

NOISE = 0.1


def _dense_check(model, net, x, y, x_test, what):
    with torch.no_grad():
        dist = model(x_test)
        mean, variance = dist.mean.detach(), dist.variance.detach()
    ref_mean, ref_variance = glm_predictive(net, x, y, x_test, 1.0, NOISE)
    close(mean, ref_mean, 1e-7, rtol=1e-7, what=f"{what} mean")
    close(variance, ref_variance, 1e-9, rtol=1e-6, what=f"{what} variance")


def _result_or_clear_error(net, x, y, x_test, what, names, **kwargs):
    """Built (then compared with the dense GLM: any error from here on is RAW) or refused at construction."""
    with untouched(net=net, train_x=x, train_y=y):
        model = attempt(lambda: ntkgp.NTKGP(net, x, y, gaussian(NOISE), **kwargs), names=names)
        if isinstance(model, Refused):
            return CLEAR, str(model)
        _dense_check(model.eval(), net, x, y, x_test, what)
    return HELD, "equals the dense GLM (jacrev)"


# ---------------------------------------------------------------------- networks
class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.spare = mlp(), nn.Linear(3, 3).double()

    def forward(self, x):
        return self.body(x)


class _Outputs(nn.Module):
    """A network returning ``(out, aux)`` or ``{"logits": out, "aux": ...}``."""

    def __init__(self, kind):
        super().__init__()
        self.body, self.kind = mlp(), kind

    def forward(self, x):
        out = self.body(x)
        return (out, out.square()) if self.kind == "tuple" else {"logits": out, "aux": out.square()}


class _GRU(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gru, self.head = nn.GRU(1, 4, batch_first=True).double(), nn.Linear(4, 1).double()

    def forward(self, x):  # (N, T, 1)
        return self.head(self.gru(x)[0][:, -1])


class _Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.embed = nn.Linear(1, 4)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):  # (N, T, 1)
        return self.head(self.encoder(self.embed(x)).mean(1))


def _sequences(n=16, t=3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, t, 1, generator=g, dtype=F64)
    return x, torch.sin(x.sum((1, 2))), torch.randn(5, t, 1, generator=g, dtype=F64)


@case("networks-01", "networks", "a parameter the forward never uses (nn.Linear beside the body): NTKGP predicts")
def unused_parameter():
    net = _Unused().eval()
    x, y = regression(20)
    return _result_or_clear_error(net, x, y, torch.linspace(-2, 2, 5, dtype=F64)[:, None], "unused parameter:",
                                  ("spare", "net"))


for _id, _kind, _pick in [("networks-02", "tuple", 0), ("networks-03", "dict", "logits")]:
    def _no_choice(kind=_kind):
        net = _Outputs(kind).eval()
        x, y = regression(20)
        with untouched(net=net):
            return refusal(lambda: ntkgp.NTKGP(net, x, y, gaussian(NOISE)), (ValueError,), names=("output",))

    def _chosen(kind=_kind, pick=_pick):
        net = _Outputs(kind).eval()
        x, y = regression(20)
        with untouched(net=net):
            model = attempt(lambda: ntkgp.NTKGP(net, x, y, gaussian(NOISE), output=pick), names=("output",))
            if isinstance(model, Refused):
                return CLEAR, str(model)
            _dense_check(model.eval(), net.body, x, y, torch.linspace(-2, 2, 5, dtype=F64)[:, None],
                         f"output={pick!r}:")
        return HELD, "equals the dense GLM of the chosen output"

    case(_id, "networks", f"a forward returning a {_kind} of outputs, no output= given")(_no_choice)
    case(f"{_id}b", "networks", f"a forward returning a {_kind} of outputs, output={_pick!r}")(_chosen)


@case("networks-04", "networks", "an uninitialized nn.LazyLinear at construction")
def lazy_linear():
    net = nn.Sequential(nn.LazyLinear(8, dtype=F64), nn.Tanh(), nn.Linear(8, 1, dtype=F64)).eval()
    x, y = regression(20)
    outcome = attempt(lambda: ntkgp.NTKGP(net, x, y, gaussian(NOISE)), (ValueError,),
                      names=("lazy", "Lazy", "'0'"))
    if not nn.parameter.is_lazy(net[0].weight):
        raise ModifiedUserObject("the user's LazyLinear was initialized by ntkgp")
    if not isinstance(outcome, Refused):
        raise SilentWrong("built on an uninitialized lazy module")
    return CLEAR, str(outcome)


@case("networks-05", "networks", "nn.GRU (batch_first) then Linear on the last step, against dense jacrev")
def gru():
    x, y, x_test = _sequences()
    return _result_or_clear_error(_GRU().eval(), x, y, x_test, "GRU:", ("gru", "GRU", "net"))


@case("networks-06", "networks", "parametrizations.weight_norm on the first Linear, against dense jacrev")
def weight_norm():
    x, y = regression(20)
    net = mlp()
    nn.utils.parametrizations.weight_norm(net[0])
    net = fit(net, x, y, steps=50)
    return _result_or_clear_error(net, x, y, torch.linspace(-2, 2, 5, dtype=F64)[:, None], "weight_norm:",
                                  ("parametriz", "weight_norm", "net"))


@case("networks-07", "networks", "nn.TransformerEncoder (1 layer, 2 heads, eval), against dense jacrev")
def transformer():
    x, y, x_test = _sequences()
    return _result_or_clear_error(_Transformer().double().eval(), x, y, x_test, "TransformerEncoder:",
                                  ("encoder", "Transformer", "net"))


# ---------------------------------------------------------------------- threads
def _in_threads(*fns):
    """Run every ``fn`` in its own thread; their results, or the exception each raised."""
    results = [None] * len(fns)

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as error:  # noqa: BLE001 - reported by the case
            results[i] = error

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@case("threads-01", "threads", "the user's net seen and run from another thread during NTKGP/SFR calls")
def network_seen_from_another_thread():
    x, y = regression(200)
    net = fit(mlp(hidden=32), x, y, steps=30)
    x_test = torch.linspace(-2, 2, 50, dtype=F64)[:, None]
    with torch.no_grad():
        expected = net(x_test)
    stop, seen = threading.Event(), []

    def watch():
        while not stop.is_set():
            kinds = {type(net[0].weight), type(net[2].weight)}
            if kinds != {nn.Parameter}:
                seen.append(f"type(net[0].weight) is {sorted(k.__name__ for k in kinds)}")
            try:
                with torch.no_grad():
                    out = net(x_test)
                if not torch.allclose(out, expected, rtol=1e-12, atol=1e-12):
                    seen.append("the user's net(x) gave other outputs")
            except Exception as error:  # noqa: BLE001
                seen.append(f"the user's net(x) raised {type(error).__name__}: {str(error)[:80]}")

    def work():
        try:
            for _ in range(2):
                model = ntkgp.NTKGP(net, x, y, gaussian(NOISE)).eval()
                with torch.no_grad():
                    model(x_test).variance
                model.log_marginal_likelihood()
                ntkgp.SFR(net, x, y, gaussian(NOISE), num_inducing=20)(x_test).variance
        finally:
            stop.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    work()
    watcher.join()
    if seen:
        raise ModifiedUserObject(f"{len(seen)} observations, first: {seen[0]}")
    return HELD, "always Parameters, the user's forward ran unchanged"


def _two_threads(build, read, threads=3, reads=6):
    """One model read by several threads at once, each on its own test inputs at every read (so that every read
    computes, and caches are filled concurrently), with the user's own forward in a loop beside them; against the
    reads of a second model, one at a time."""
    x, y = regression(60)
    net = fit(mlp(hidden=16), x, y, steps=30)
    tests = [[torch.linspace(-2, 2, 40, dtype=F64)[:, None] + 0.01 * (i * reads + k) for k in range(reads)]
             for i in range(threads)]
    reference = build(net, x, y)
    expected = [[read(reference, t) for t in row] for row in tests]
    with torch.no_grad():
        own = net(x)
    model, stop = build(net, x, y), threading.Event()

    def user():
        bad = 0
        while not stop.is_set():
            with torch.no_grad():
                bad += not torch.allclose(net(x), own, rtol=1e-12, atol=1e-12)
        return bad

    def reader(row):
        try:
            return [read(model, t) for t in row]
        finally:
            stop.set() if row is tests[-1] else None

    results = _in_threads(user, *[lambda row=row: reader(row) for row in tests])
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if results[0]:
        raise ModifiedUserObject(f"the user's net(x) in another thread gave other outputs {results[0]} times")
    for result, want in zip(results[1:], expected):
        for got, ref in zip(result, want):
            close(got, ref, 1e-10, rtol=1e-8, what="a concurrent read")
    return HELD, "the one-thread numbers"


def _moments(model, t):
    with torch.no_grad():
        dist = model(t)
        return torch.cat([dist.mean.reshape(-1), dist.variance.reshape(-1)])


@case("threads-02", "threads", "two threads predicting with one NTKGP (function space) at once")
def threads_ntkgp():
    return _two_threads(lambda net, x, y: ntkgp.NTKGP(net, x, y, gaussian(NOISE), space="function").eval(), _moments)


@case("threads-03", "threads", "two threads predicting with one SFR at once")
def threads_sfr():
    return _two_threads(lambda net, x, y: ntkgp.SFR(net, x, y, gaussian(NOISE), inducing_points=x[:20]), _moments)


@case("threads-04", "threads", "two threads predicting with one FSVI model at once")
def threads_fsvi():
    return _two_threads(lambda net, x, y: FSVI(net, gaussian(NOISE)).eval(), _moments)


@case("threads-05", "threads", "two threads evaluating one NTKKernel at once")
def threads_kernel():
    def read(kernel, t):
        with torch.no_grad():
            return kernel(t, t).to_dense()

    return _two_threads(lambda net, x, y: ntkgp.NTKKernel(net), read)
