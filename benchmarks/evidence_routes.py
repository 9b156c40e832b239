"""Every route of the Laplace evidence against laplace-torch, side by side in one run.

Four problems (float64, networks trained to a MAP point with Adam): Snelson-sized regression (N = 200,
1-50-50-50-1 tanh, P = 5251: function space), UCI energy (split 0, N = 691, 8-50-1 tanh, P = 501: weight space),
scikit-learn digits (70 % train, N = 1257, C = 10, 64-32-10 tanh, P = 2410: weight space) and its classes 0-2
(N = 376, C = 3, 64-32-3 tanh, P = 2179: function space). For each: the full GGN (ntkgp: ``NTKGP`` + the MLL,
the space chosen by ``choose_space``; laplace-torch ``FullLaplace``), KFAC (``compute_curvature("kfac")``;
``KronLaplace``) and the diagonal GGN (``"diag_ggn"``; ``DiagLaplace``), with one δ and with one δ per parameter
tensor (ntkgp's KFAC: one per layer, its weight and bias share a Kronecker block; laplace-torch's KFAC keeps weight
and bias in separate blocks, each with its own δ). Measured: the build (one pass over the data and the first
evidence; a build under 0.3 s: the mean of repeated builds after the first, on both sides), the time of one
hyperparameter step (Adam on log δ, and on the noise for regression; the mean of at least ``--steps`` steps
and 0.3 s after one warm-up step; where both libraries run, the two steps are then timed again in alternation,
five rounds for steps under 25 ms, and each side's median counts) and the GLM predictive covariance at 1,000
points. Times are
the CPU time of the process (``time.process_time``) with ``--threads`` threads (default 1), which the load of other
processes on a shared machine changes little; with one thread it is the time the work took. Beside each row,
measured lower bounds (``benchmarks/route_bounds.py``): the floor of its hyperparameter step (an Adam step on the
same hyperparameters after the backward pass of a one-operation graph), the bare step (the kernels of its evidence
step on the same numbers, plus the floor) and the bare build; a row whose target is below its bound cannot meet it.

    python benchmarks/evidence_routes.py --data-dir DATA [--steps 5] [--threads 1] [--crossover] [--write-docs]
        [--only PROBLEM,...] [--routes full,kfac,diag_ggn]

Run with an interpreter that has laplace-torch (kept out of ntkgp's dependencies); without it only ntkgp's side
is measured. ``--crossover`` also times one evidence step in each space on a grid of N·C / P and prints where
weight space becomes the cheaper one (the rule of :func:`ntkgp.options.choose_space`). ``--write-docs`` writes
the table into docs/ntkgp.md (generated region ``ntkgp-evidence-routes``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import gpytorch
import torch
from torch import nn

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.laplace.weight_space import DiagLaplace, KFACLaplace, compute_curvature
from ntkgp.likelihoods import SoftmaxLikelihood
from route_bounds import (MIN_SECONDS, ROUND_LIMIT, alternating_steps, bare_full_build, bare_full_step, bare_kfac_build,
                          bare_low_rank_step, bare_structured_step, floor_step, per_step, quiet_collector, warm_torch)
from ntkgp.laplace.ggn.layer_ggn import layer_ggn_layers
from ntkgp.laplace.ggn.low_rank_groups import low_rank_cheaper
from ntkgp.laplace.ggn.scaling import unit_root_columns

TEST_POINTS = 1000


# ---------------------------------------------------------------------------------------------- problems
def mlp(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def train(net: nn.Module, x, y, regression: bool, steps: int = 1000, delta: float = 1.0) -> nn.Module:
    """MAP with Adam, full batch, prior precision ``delta`` per weight."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        out = net(x)
        fit = ((out.squeeze(-1) - y) ** 2).sum() / (2 * 0.1**2) if regression else nn.functional.cross_entropy(
            out, y, reduction="sum")
        loss = fit + 0.5 * delta * sum((p**2).sum() for p in net.parameters())
        loss.backward()
        opt.step()
    for p in net.parameters():
        p.grad = None
    return net.eval()


def problems(data_dir: str | None):
    torch.manual_seed(0)
    out = []
    if data_dir and (Path(data_dir) / "toy").is_dir():
        x, y, _ = ntkgp.datasets.load_snelson(data_dir)
        y = y.reshape(-1)
        name = "Snelson"
    else:
        x = torch.rand(200, 1, dtype=torch.float64) * 6
        y = torch.sin(x[:, 0]) + 0.3 * torch.randn(200, dtype=torch.float64)
        name = "Snelson-sized (synthetic)"
    out.append((name, "regression", x, y, mlp([1, 50, 50, 50, 1])))
    if data_dir and (Path(data_dir) / "uci_regression").is_dir():
        split = ntkgp.datasets.load_uci_regression(data_dir, "energy", split=0)
        out.append(("UCI energy", "regression", split.x_train, split.y_train.reshape(-1), mlp([8, 50, 1])))
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_all = torch.tensor(digits.data / 16.0, dtype=torch.float64)
    y_all = torch.tensor(digits.target)
    x_tr, _, y_tr, _ = train_test_split(x_all, y_all, train_size=0.7, random_state=0, stratify=y_all)
    out.append(("digits", "classification", x_tr, y_tr, mlp([64, 32, 10])))
    keep = y_all < 3
    x3, _, y3, _ = train_test_split(x_all[keep], y_all[keep], train_size=0.7, random_state=0, stratify=y_all[keep])
    out.append(("digits 0-2", "classification", x3, y3, mlp([64, 32, 3])))
    trained = []
    for name, task, x, y, net in out:
        train(net, x, y.to(torch.float64) if task == "regression" else y, task == "regression")
        trained.append((name, task, x, y, net))
    return trained


def test_inputs(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    low, high = x.min(0).values, x.max(0).values
    return low + (high - low) * torch.rand(TEST_POINTS, x.shape[1], generator=g, dtype=x.dtype)


def timed(fn):
    """``fn()`` and the CPU seconds of the process it took (module docstring)."""
    with quiet_collector():
        start = time.process_time()
        value = fn()
        return value, time.process_time() - start


def timed_build(build):
    """``build()`` (the first call's value) and its CPU seconds: the first call's where that took ``MIN_SECONDS``
    or more, else the mean of repeated builds after it, as the steps are timed (a build of a few milliseconds timed
    once is noise: the same code measured 0.66× and 0.96× in two runs). Every repeat builds anew from the network
    and the data; what persists is what persists for a user who builds again in the same process."""
    first = timed(build)
    return first if first[1] >= MIN_SECONDS else (first[0], per_step(build, 3))


# ---------------------------------------------------------------------------------------------- ntkgp
def ntkgp_likelihood(task: str, c: int):
    if task == "regression":
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.1**2
        return lik
    return SoftmaxLikelihood(num_classes=c).double()


def block_shapes(model, x, k: int) -> list[tuple[int, int]] | None:
    """``(d_a, d_out)`` of the layers whose blocks form ntkgp's weight-space GGN for this row, or ``None`` where it
    takes the Jacobian's rows (ntkgp's own rule, :func:`~ntkgp.laplace.ggn.layer_ggn.layer_ggn_layers`)."""
    engine = model.covar_module.engine
    xp = engine.prepare(x)
    layers = layer_ggn_layers(engine.core, engine.plan(xp), k, False, False)
    return None if layers is None else [(layer.fan_in + (layer.bias is not None), layer.d_out) for layer in layers]


def full_ggn(net, x, y, lik) -> torch.Tensor:
    """The row's GGN ``P × P`` (untimed: the bare build factorizes it, whose time depends on its spectrum)."""
    return ntkgp.laplace.compute_curvature(net, x, y, lik, "full_ggn").dense(lik)


def ntkgp_full(task, x, y, net, prior_structure, steps, x_test):
    lik = ntkgp_likelihood(task, net[-1].out_features)

    def build():
        model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0, prior_structure=prior_structure,
                            predictive_mean="nn")  # laplace-torch's GLM predictive mean: the network's output
        return model, model.log_marginal_likelihood().item()

    (model, first), t_build = timed_build(build)
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    model.train()
    opt = torch.optim.Adam(model.hyperparameters(), lr=0.1)

    def step():
        opt.zero_grad()
        (-mll(model(x), y)).backward()
        opt.step()

    _, t_first = timed(step)  # on the Schur route the largest group's block is decomposed here, once
    t_step = per_step(step, steps)
    model.eval()

    def predict():
        with torch.no_grad():
            return model(x_test).variance

    t_pred = timed(predict)[1]
    k = net[-1].out_features if task == "classification" else 1
    rows = x.shape[0] * unit_root_columns(lik, k)  # the function-space side: N·(C − 1) for a softmax GGN
    from ntkgp.options import choose_space

    p = sum(q.numel() for q in net.parameters())
    space = choose_space("auto", p, rows).value
    one, weight, regression = prior_structure == "network", space == "weight", task == "regression"
    groups = model.covar_module.engine.num_groups
    floor = floor_step(groups, regression, steps)
    sizes = [q.numel() for q in net.parameters()]  # the per-tensor groups (prior_structure="parameter")
    schur = weight and not one and low_rank_cheaper(torch.tensor(sizes))  # ntkgp's several-δ Schur route
    if schur:  # its one-time decomposition belongs to the build: the first step's time above a step's
        t_build += max(t_first - t_step, 0.0)
    bounds = {"floor": floor,
              "bare_step": (bare_low_rank_step(sizes, regression, steps, floor) if schur else
                            bare_full_step(min(p, rows) if one else p if weight else rows,
                                           groups, one, not weight, regression, steps, floor)),
              "bare_build": bare_full_build(rows, p, weight, one,
                                            block_shapes(model, x, k) if weight else None, x.shape[0],
                                            full_ggn(net, x, y, lik) if weight else None)}
    return {"build": t_build, "step": t_step, "step_fn": step, "before_steps": model.train, "pred": t_pred,
            "first": first, "route": f"full GGN, {space} space",
            **bounds}


def ntkgp_structured(task, x, y, net, structure, prior_structure, steps, x_test):
    lik = ntkgp_likelihood(task, net[-1].out_features)

    def build():
        curvature = compute_curvature(net, x, y, lik, structure, prior_structure=prior_structure, batch_size=256)
        return curvature, curvature.log_marginal_likelihood(1.0, lik).item()

    (curvature, first), t_build = timed_build(build)
    log_delta = torch.zeros(curvature.groups.num_groups, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([log_delta, *[p for p in lik.parameters() if p.requires_grad]], lr=0.1)

    def step():
        opt.zero_grad()
        (-curvature.log_marginal_likelihood(log_delta.exp(), lik)).backward()
        opt.step()

    t_step = per_step(step, steps)
    delta = log_delta.detach().exp()

    def predict():
        if structure == "kfac":
            posterior = KFACLaplace.from_curvature(curvature, net, lik, prior_precision=delta)
        else:
            posterior = DiagLaplace.from_curvature(curvature, net, lik, prior_precision=delta)
        return posterior.glm_covariance(x_test)

    t_pred = timed(predict)[1]
    regression = task == "regression"
    bounds = {"floor": floor_step(curvature.groups.num_groups, regression, steps),
              "bare_step": bare_structured_step(curvature, lik, regression, steps),
              "bare_build": bare_kfac_build(net, x) if structure == "kfac" and net[-1].out_features == 1 else None}
    return {"build": t_build, "step": t_step, "step_fn": step, "pred": t_pred, "first": first, "route": structure,
            **bounds}


# ---------------------------------------------------------------------------------------------- laplace-torch
def laplace_torch(task, x, y, net, structure, per_tensor, steps, x_test):
    import laplace

    cls = {"full": laplace.FullLaplace, "kfac": laplace.KronLaplace, "diag_ggn": laplace.DiagLaplace}[structure]
    n_tensors = len(list(net.parameters()))
    sigma = 0.1 if task == "regression" else 1.0
    prior = torch.ones(n_tensors, dtype=torch.float64) if per_tensor else torch.tensor(1.0, dtype=torch.float64)
    targets = y.reshape(-1, 1) if task == "regression" else y  # laplace-torch: (N, 1) regression targets
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, targets), batch_size=256)

    def build():
        la = cls(net, task, sigma_noise=sigma, prior_precision=prior.clone())
        la.fit(loader)
        return la, la.log_marginal_likelihood().item()

    (la, first), t_build = timed_build(build)
    log_prior = torch.zeros_like(prior, requires_grad=True)
    log_sigma = torch.tensor(float(torch.log(torch.tensor(sigma))), dtype=torch.float64, requires_grad=True)
    params = [log_prior, log_sigma] if task == "regression" else [log_prior]
    opt = torch.optim.Adam(params, lr=0.1)

    def step():
        opt.zero_grad()
        if task == "regression":
            value = la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        else:
            value = la.log_marginal_likelihood(log_prior.exp())
        (-value).backward()
        opt.step()

    t_step = per_step(step, steps)
    with torch.no_grad():
        la.prior_precision = log_prior.detach().exp()
        if task == "regression":
            la.sigma_noise = log_sigma.detach().exp()
    t_pred = timed(lambda: la._glm_predictive_distribution(x_test))[1]
    return {"build": t_build, "step": t_step, "step_fn": step, "pred": t_pred, "first": first}


def have_laplace() -> bool:
    try:
        import laplace  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- crossover
def crossover(steps: int) -> list[tuple[float, float, float, float]]:
    """One exact evidence step (per-tensor δ, softmax, 3 classes) in each space for N·C / P on a grid."""
    net = mlp([20, 24, 24, 3])  # P = 1179
    p = sum(q.numel() for q in net.parameters())
    out = []
    for ratio in (0.5, 0.75, 1.0, 1.5, 2.0):
        n = int(round(ratio * p / 3))
        x = torch.randn(n, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        y = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(1))
        lik = SoftmaxLikelihood(num_classes=3).double()
        times = []
        for space in ("function", "weight"):
            model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0, prior_structure="parameter")
            model.log_marginal_likelihood(space=space, method="cholesky")  # build the curvature

            def step():
                value = model.log_marginal_likelihood(space=space, method="cholesky")
                value.backward()

            step()
            times.append(timed(lambda: [step() for _ in range(steps)])[1] / steps)
        out.append((n * 3 / p, n * 2 / p, *times))  # R = N·(C − 1): the softmax GGN's function-space side
        print(f"N·C/P = {n * 3 / p:.2f} (R/P = {n * 2 / p:.2f}): function {times[0] * 1e3:.1f} ms, "
              f"weight {times[1] * 1e3:.1f} ms per step")
    return out


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("NTKGP_DATA_DIR"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--only", default=None, help="run only these problems (names, comma-separated)")
    parser.add_argument("--routes", default="full,kfac,diag_ggn",
                        help="run only these routes (full, kfac, diag_ggn; comma-separated)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(args.threads)
    other = have_laplace()
    warm_torch()
    points = crossover(args.steps) if args.crossover else None
    rows = []
    order = ["digits", "digits 0-2", "UCI energy"]  # the problems of the issue first; Snelson (P = 5251) last
    found = problems(args.data_dir)
    found.sort(key=lambda item: order.index(item[0]) if item[0] in order else len(order))
    for name, task, x, y, net in found:
        if args.only and name not in args.only.split(","):
            continue
        x_test = test_inputs(x)
        c = net[-1].out_features
        p = sum(q.numel() for q in net.parameters())
        label = f"{name} (N = {x.shape[0]}, C = {c}, P = {p})"
        for per_tensor in (False, True):
            prior = "parameter" if per_tensor else "network"
            for structure in [r for r in ("full", "kfac", "diag_ggn") if r in args.routes.split(",")]:
                if structure == "full":
                    ours = ntkgp_full(task, x, y, net, prior, args.steps, x_test)
                else:
                    grouping = ("layer" if structure == "kfac" else "parameter") if per_tensor else "network"
                    ours = ntkgp_structured(task, x, y, net, structure, grouping, args.steps, x_test)
                theirs = laplace_torch(task, x, y, net, structure, per_tensor, args.steps, x_test) if other else None
                prepare, step = ours.pop("before_steps", None), ours.pop("step_fn")
                if theirs is not None:  # both steps timed again in alternation, under the same machine state
                    if prepare is not None:
                        prepare()  # the MLL's model back in train mode
                    ours["step"], theirs["step"] = alternating_steps(step, theirs.pop("step_fn"), args.steps,
                                                                   (ours["step"], theirs["step"]))
                rows.append((label, "per tensor" if per_tensor else "one", ours, theirs))
                print(format_row(rows[-1]), flush=True)
        if args.write_docs:  # after each problem: a long run leaves what it measured
            write_docs(rows, points, other, args.threads)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2g}×"


def format_row(row) -> str:
    label, prior, ours, theirs = row
    cells = [label, ours["route"], f"δ: {prior}", f"build {ours['build']:.3g} s", f"step {ours['step'] * 1e3:.3g} ms",
             f"predict {ours['pred']:.3g} s", f"evidence {ours['first']:.6g}",
             "floor / bare step ms, bare build s " + " ".join(bounds_cells(ours))]
    if theirs is not None:
        cells += [f"| laplace-torch build {theirs['build']:.3g} s", f"step {theirs['step'] * 1e3:.3g} ms",
                  f"predict {theirs['pred']:.3g} s", f"evidence {theirs['first']:.6g}",
                  f"| ratios {ratio(ours['build'], theirs['build'])} {ratio(ours['step'], theirs['step'])} "
                  f"{ratio(ours['pred'], theirs['pred'])}"]
    return ", ".join(cells)


def bounds_cells(ours) -> list[str]:
    build = "—" if ours["bare_build"] is None else f"{ours['bare_build']:.3g}"
    return [f"{ours['floor'] * 1e3:.3g} / {ours['bare_step'] * 1e3:.3g}", build]


def write_docs(rows, points, other: bool, threads: int) -> None:
    header = ["problem", "ntkgp route", "δ", "build s", "step ms", "predictive s (1,000 points)"]
    if other:
        header += ["laplace-torch build s", "step ms", "predictive s", "ratio build / step / predictive"]
    header += ["bound: floor / bare step ms", "bare build s"]
    if other:
        header += ["evidence ntkgp / laplace-torch"]
    table = []
    for label, prior, ours, theirs in rows:
        row = [label, ours["route"], prior, f"{ours['build']:.3g}", f"{ours['step'] * 1e3:.3g}", f"{ours['pred']:.3g}"]
        if theirs is not None:
            row += [f"{theirs['build']:.3g}", f"{theirs['step'] * 1e3:.3g}", f"{theirs['pred']:.3g}",
                    " / ".join(ratio(ours[k], theirs[k]) for k in ("build", "step", "pred"))]
        row += bounds_cells(ours)
        if theirs is not None:
            row += [f"{ours['first']:.6g} / {theirs['first']:.6g}"]
        table.append(row)
    text = markdown_table(header, table)
    text += (f"\n\nCPU time of the process, {threads} thread(s); a step is the mean over at least --steps steps and "
             f"{MIN_SECONDS} s (both libraries' steps timed in alternation, five rounds where a step takes under "
             f"{ROUND_LIMIT * 1e3:.0f} ms, the median of each side's rounds), and every timing starts after a garbage collection with the collector paused "
             "during it (as timeit does); the build of a several-δ row on the Schur route includes the one-time "
             "decomposition of the largest group's block made at its second evaluation (the first step's time above "
             "the mean step). Bounds (benchmarks/route_bounds.py): the floor, an Adam step on the row's "
             "hyperparameters after the backward pass of a one-operation graph; the bare step, the row's evidence "
             "step's kernels on the same numbers plus the floor (KFAC, diagonal: the shifted eigenvalues, their reciprocals, "
             "logarithms and sums outside autograd; one δ full GGN: its spectral formula with autograd; several δ: "
             "one Cholesky factorization of the row's matrix and one triangular inverse, or with several Grams B⁻¹ "
             "from the factor (cholesky_inverse) and their inner products, or where ntkgp takes the "
             "Schur route its k × k kernels, plus the floor); the bare build, the products that form the curvature "
             "(the Gram of the Jacobian's rows, or where ntkgp forms the GGN from layer features one product per "
             "pair of layers) and the first factorization or eigenvalues of the row's own matrix (full GGN), or one "
             "forward and one backward pass, the Kronecker factors and their eigenvalues (KFAC, one output).")
    if points:
        text += ("\n\nOne exact evidence step (value and gradient) in each space, softmax with 3 classes, P = 1179 "
                 "(the function-space side is R = N·(C − 1), the rows of the softmax's root with C − 1 columns):\n\n")
        text += markdown_table(["N·C / P", "R / P", "function space ms", "weight space ms"],
                               [[f"{r:.2f}", f"{q:.2f}", f"{a * 1e3:.3g}", f"{b * 1e3:.3g}"]
                                for r, q, a, b in points])
    note = "  # with laplace-torch importable" if other else ""
    write_block("docs/ntkgp.md", "ntkgp-evidence-routes", text, command_line() + note)


if __name__ == "__main__":
    main()
