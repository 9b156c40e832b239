"""``benchmarks/audit.py``: its verdicts are the right ones, and the fast areas of the audit stay clean.

The audit (issue 25's second one) runs as a benchmark script (``python benchmarks/audit.py``, 2 minutes); here
only what takes seconds: the classification of each outcome on made-up cases whose outcome is known, and the
``likelihoods`` and ``data`` areas, whose failures were fixed (each fix has its own test in its folder).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import audit
from benchmarks.audit_cases import framework as fw
from benchmarks.audit_cases import load


def _verdict(fn):
    return audit.run_case(fw.Case("test-00", "test", "made up", fn))[0]


def _net():
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))


def test_each_outcome_is_recognized():
    def held():
        fw.close(torch.ones(3), torch.ones(3), 0.0)
        return fw.HELD, "equal"

    def clear():
        return fw.refusal(lambda: int("x"), (ValueError,), names=("invalid literal",))

    def silent():
        fw.close(torch.ones(3), torch.zeros(3), 1e-3)

    def accepted():
        return fw.refusal(lambda: 1, names=("x",))

    def unclear():
        return fw.refusal(lambda: int("x"), (ValueError,), names=("argument_name",))

    def raw():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    for fn, outcome in [(held, fw.HELD), (clear, fw.CLEAR), (silent, fw.SILENT), (accepted, fw.SILENT),
                        (unclear, fw.RAW), (raw, fw.RAW)]:
        assert _verdict(fn) == outcome, fn.__name__


@pytest.mark.parametrize("change", ["weight", "grad_values", "grad_object", "flag", "mode", "hook", "input"])
def test_every_kind_of_change_to_a_user_object_is_caught(change):
    net, x = _net(), torch.randn(4, 2)
    net[0].weight.grad = torch.zeros_like(net[0].weight)

    def modify():
        with fw.untouched(net=net, x=x):
            if change == "weight":
                net[2].bias.data.add_(1e-6)  # (1e-12 would round away in float32)
            elif change == "grad_values":
                net[0].weight.grad.add_(1.0)
            elif change == "grad_object":
                net[0].weight.grad = net[0].weight.grad.clone()
            elif change == "flag":
                net[2].weight.requires_grad_(False)
            elif change == "mode":
                net[1].train(not net[1].training)
            elif change == "hook":
                net[2].register_forward_hook(lambda *args: None)
            else:
                x[0, 0] = float("nan")
        return fw.HELD, ""

    assert _verdict(modify) == fw.MODIFIED


def test_a_change_before_an_error_is_a_modification_and_state_false_ignores_trained_weights():
    net = _net()

    def raises_after_a_change():
        with fw.untouched(net=net):
            net[0].bias.data.zero_()
            raise ValueError("x is bad")

    assert _verdict(raises_after_a_change) == fw.MODIFIED

    def trains():
        with fw.untouched(state=False, net=net):
            net[0].bias.data.add_(1.0)
        return fw.HELD, ""

    assert _verdict(trains) == fw.HELD


@pytest.mark.parametrize("area", ["likelihoods", "data"])
def test_the_fast_areas_hold(area):
    load([area])
    results = {c.id: audit.run_case(c) for c in fw.iter_cases([area])}
    assert len(results) >= 10
    bad = {k: v for k, v in results.items() if v[0] not in (fw.HELD, fw.CLEAR)}
    assert not bad
