"""The demo's parts: its tasks, the evidence refit, the lines under its table and what its figures draw."""

from __future__ import annotations

import math

import pytest
import torch

import ntkgp
from ntkgp import plotting
from ntkgp.demo import QUICK, DemoRow, gap_regression_task, two_moons_task
from ntkgp.demo.notes import REFIT, explain
from ntkgp.likelihoods import LogisticLikelihood
from ntkgp.plotting.maps import _nice_ceiling

pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")


def test_two_moons_new_batch_is_the_tip_of_the_lower_moon():
    task = two_moons_task(QUICK)
    assert (task.y_new == 1).all()
    assert len(task.x_new) == round(QUICK.new_fraction * QUICK.n_classification)
    kept = task.x_train[task.y_train == 1, 0]
    assert task.x_new[:, 0].max() <= kept.min()  # the class-1 points furthest left, none of them kept
    assert len(task.x_train) + len(task.x_new) == QUICK.n_classification


def test_gap_regression_task_names_its_gap():
    task = gap_regression_task(QUICK)
    ((low, high),) = task.gaps
    assert not ((task.x_train > low) & (task.x_train < high)).any()
    assert ((task.x_new >= low) & (task.x_new <= high)).all()


@pytest.mark.parametrize("value", [1e-3, 0.0123, 0.07, 0.1, 0.11, 0.2, 0.21, 0.3, 0.26, 0.5, 0.51, 0.9, 1.0, 3.7, 42.0])
def test_nice_ceiling_is_the_smallest_round_bound(value):
    candidates = sorted(m * 10.0**k for m in (1, 2, 2.5, 5) for k in range(-4, 4))
    assert _nice_ceiling(value) == pytest.approx(next(c for c in candidates if c >= value * (1 - 1e-12)))


def _map_figure():
    grid = plotting.grid_2d(torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64), resolution=12)
    z = grid.points.sum(-1)
    before, after = torch.sigmoid(z), torch.sigmoid(2 * z + 0.3)
    x = torch.tensor([[-0.5, -0.5], [0.5, 0.5], [0.2, -0.4]], dtype=torch.float64)
    y = torch.tensor([0, 1, 1])
    fig, axes = plotting.new_figure(1, 3)
    plotting.plot_probability_map(axes[0][0], grid, before, x=x, y=y, marked=x[1:])
    plotting.plot_uncertainty_map(axes[0][1], grid, before, x=x, y=y)
    plotting.plot_change_map(axes[0][2], grid, before, after, label="Δ P", marked=x[1:], y_marked=y[1:])
    return fig, axes, before, after


def test_maps_have_round_ticks_class_markers_and_a_legend():
    fig, axes, before, after = _map_figure()
    fig.canvas.draw()
    colorbars = [ax for ax in fig.axes if ax not in axes[0]]
    assert len(colorbars) == 3

    def shown(bar) -> list[float]:
        low, high = bar.get_ylim()
        return [float(t) for t in bar.get_yticks() if low - 1e-9 <= t <= high + 1e-9]

    ticks = [shown(bar) for bar in colorbars]
    assert ticks[0] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(abs(t * 10 - round(t * 10)) < 1e-9 for t in ticks[1]) and max(ticks[1]) <= math.log(2)
    top = _nice_ceiling(float((after - before).abs().max()))
    assert ticks[2] == pytest.approx([-top, -top / 2, 0.0, top / 2, top])
    # one scatter per class, with white edges, distinct markers; the legend names the classes and the ring
    from matplotlib.collections import PathCollection

    points = [c for c in axes[0][0].collections if isinstance(c, PathCollection) and c.get_facecolors().shape[0]]
    assert len(points) == 2 and all((c.get_edgecolors()[:, :3] == 1).all() for c in points)
    assert points[0].get_paths()[0] != points[1].get_paths()[0]
    labels = [t.get_text() for t in axes[0][0].get_legend().get_texts()]
    assert labels == ["class 0", "class 1", "new batch (added by the update)"]


def test_regression_panel_draws_the_bands_of_f_and_y():
    x = torch.linspace(-1, 1, 20, dtype=torch.float64)[:, None]
    fig, axes = plotting.new_figure(1, 2)
    f_std = 0.1 + x.squeeze(-1).abs()
    std = (f_std.square() + 0.04).sqrt()
    plotting.plot_regression(axes[0][0], x, torch.zeros(20), std, f_std=f_std, x_train=x[:5], y_train=x[:5],
                             gaps=[(-0.2, 0.2)])
    plotting.plot_std(axes[0][1], x, {"before": f_std, "after": 0.5 * f_std}, noise_std=0.2, gaps=[(-0.2, 0.2)])
    labels = axes[0][0].get_legend_handles_labels()[1]
    assert labels[:3] == ["gap: no training data", r"$\pm$ 2 std of y (f + noise)", r"$\pm$ 2 std of f"]
    bands = [c for c in axes[0][0].collections if c.get_label().startswith(r"$\pm$")]
    tops = [b.get_paths()[0].vertices[:, 1].max() for b in bands]
    assert tops[0] == pytest.approx(2 * float(std.max()), rel=1e-6) and tops[1] == pytest.approx(2 * float(f_std.max()))
    lines = {line.get_label(): line.get_ydata() for line in axes[0][1].get_lines()}
    assert list(lines["after"]) == pytest.approx((0.5 * f_std).tolist())
    assert "noise std σ = 0.2" in lines


def _row(model: str, evidence=None, nlpd=0.1, ece=None, task="t") -> DemoRow:
    return DemoRow(task, model, 10, evidence, nlpd, None, None, ece, None, None, None, None)


def _acc(model: str, evidence=None, nlpd=0.1, ece=0.01, task="c") -> DemoRow:
    return DemoRow(task, model, 10, evidence, nlpd, None, 0.9, ece, None, None, None, None)


def test_notes_give_reasons_only_where_they_hold():
    rows = [_acc("network (MAP)", nlpd=0.09, ece=0.005), _acc("NTKGP", 0.57, 0.12, 0.043),
            _acc("NTKGP + new batch", 0.19, 0.11, 0.041), _acc(REFIT, 0.58, 0.119, 0.038),
            _acc("SFR (M=4)", 0.61, 0.12, 0.043), _acc("SFR + new batch", 0.63, 0.11, 0.034)]
    lines = explain(rows)
    assert len(lines) == 2
    assert lines[0].startswith("[c] NTKGP's evidence/N falls after the update (0.570 → 0.190)")
    assert "SFR's column rises" in lines[0]
    assert "ECE (0.043) is above the network's (0.005)" in lines[1] and "lowers it only (ECE 0.038)" in lines[1]
    assert "although its test NLPD improves" in lines[0]
    fixed = [*rows[:3], _acc(REFIT, 0.58, 0.09, 0.004)]
    assert "fixes it: ECE 0.004" in explain(fixed)[1]
    for ece, effect in ((0.0435, "leaves it as it is"), (0.05, "raises it")):
        assert f"{effect} (ECE {ece:.3f})" in explain([*rows[:3], _acc(REFIT, 0.58, 0.1, ece)])[1]
    worse = [rows[0], rows[1], _acc("NTKGP + new batch", 0.19, 0.13, 0.041)]
    assert "falls after the update (0.570 → 0.190): the Laplace" in explain(worse)[0]
    # the network confidently wrong where NTKGP is not; SFR's update worse while NTKGP's is better
    tip = [_acc("network (MAP)", nlpd=0.35, ece=0.05), _acc("NTKGP", -0.1, 0.2, 0.05),
           _acc("NTKGP + new batch", -0.4, 0.12, 0.03), _acc("SFR (M=4)", -0.1, 0.2, 0.05),
           _acc("SFR + new batch", -0.1, 0.33, 0.04)]
    lines = explain(tip)
    assert len(lines) == 3 and "NTKGP's test NLPD (0.200) is below the network's (0.350)" in lines[1]
    assert "SFR's test NLPD rises after the update (0.200 → 0.330) while NTKGP's falls (0.200 → 0.120)" in lines[2]
    # regression rows (no accuracy) get no classification notes; nothing to explain gives no line
    regression = [_row(r.model, r.evidence, r.nlpd, None, task="r") for r in tip]
    assert len(explain(regression)) == 1
    calm = [_acc("network (MAP)", nlpd=0.2, ece=0.05), _acc("NTKGP", 0.5, 0.1, 0.01),
            _acc("NTKGP + new batch", 0.6, 0.09, 0.01)]
    assert "[c] NTKGP's test NLPD (0.100) is below" in explain(calm)[0] and len(explain(calm)) == 1
    assert explain([_row("network (MAP)", nlpd=0.2), _row("NTKGP", 0.5, 0.3), _row("NTKGP + new batch", 0.6, 0.2)]) == []


def test_optimize_prior_precision_maximizes_the_evidence():
    torch.manual_seed(0)
    x = torch.randn(30, 2, dtype=torch.float64)
    y = (x[:, 0] + 0.3 * torch.randn(30, dtype=torch.float64) > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()

    def evidence(delta: torch.Tensor) -> float:
        fresh = ntkgp.NTKGP(net, x, y, LogisticLikelihood().double(), prior_precision=delta)
        with torch.no_grad():
            return fresh.log_marginal_likelihood().item()

    start = torch.tensor([3.0, 0.3], dtype=torch.float64)
    model = ntkgp.NTKGP(net, x, y, LogisticLikelihood().double(), prior_precision=start)
    model.optimize_prior_precision(optimizer="lbfgs")
    delta = model.covar_module.prior_precision.detach().reshape(-1)
    best = evidence(delta)
    assert best > evidence(start) + 1e-3
    for k in range(2):  # a maximum in each prior precision, by a freshly built model on either side
        for factor in (1.2, 1 / 1.2):
            moved = delta.clone()
            moved[k] *= factor
            assert evidence(moved) < best
    assert all(p.grad is None for p in net.parameters())  # δ alone was optimized
