"""``benchmarks/audit.py``: its verdicts are the right ones, and the fast areas of the audit stay clean.

The audit (issue 25's second one) runs as a benchmark script (``python benchmarks/audit.py``, 2 minutes); here
only what takes seconds: the classification of each outcome on made-up cases whose outcome is known, and the
``likelihoods`` and ``data`` areas, whose failures were fixed (each fix has its own test in its folder), that every
subject of issue 38 has its round-four cases, and the quick ones among them (all of them with ``--runslow``).
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


# ---------------------------------------------------------------------- the fourth round (issue 38)
ROUND_FOUR = {  # what issue 38 lists, and the cases that try it
    "float32 function-space mean": ["numerics-16"], "evidence from a tensor and a list δ": ["numerics-17"],
    "stale distributions": ["ntkgp-33", "ntkgp-34", "ntkgp-35", "ntkgp-36", "ntkgp-37", "ntkgp-38", "ntkgp-39",
                            "sfr-30", "sfr-31", "fsvi-25"],
    "the network seen from another thread": ["threads-01"],
    "threads sharing one model": ["threads-02", "threads-03", "threads-04", "threads-05"],
    "unused parameters": ["networks-01"], "tuple and dict outputs": ["networks-02", "networks-02b", "networks-03",
                                                                     "networks-03b"],
    "LazyLinear, GRU, weight_norm, TransformerEncoder": ["networks-04", "networks-05", "networks-06", "networks-07"],
    "deepcopy of KFAC and diagonal posteriors": ["posteriors-24", "posteriors-25"],
    "train_marglik with inputs that require grad": ["marglik-21"], "arrays to SFR": ["sfr-32"],
    "float32 SFR variance": ["sfr-33"],
}


def test_every_subject_of_issue_38_has_its_cases():
    load(["ntkgp", "networks"])  # the round-four modules (with the older areas' and the networks' cases)
    registered = {c.id for c in fw.iter_cases()}
    missing = {subject: [i for i in ids if i not in registered] for subject, ids in ROUND_FOUR.items()}
    assert not {k: v for k, v in missing.items() if v}


@pytest.mark.parametrize("case_id", ["networks-02", "networks-03", "networks-04", "sfr-32"])
def test_the_quick_round_four_cases_hold(case_id):
    load(["ntkgp", "networks"])
    (c,) = fw.iter_cases(ids=[case_id])
    assert audit.run_case(c)[0] in (fw.HELD, fw.CLEAR)


@pytest.mark.slow
def test_the_round_four_cases_hold():
    load(["ntkgp", "networks"])
    ids = [i for ids in ROUND_FOUR.values() for i in ids]
    results = {c.id: audit.run_case(c) for c in fw.iter_cases(ids=ids)}
    assert not {k: v for k, v in results.items() if v[0] not in (fw.HELD, fw.CLEAR)}
