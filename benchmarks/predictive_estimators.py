"""Every estimator of the GLM predictive against the exact full-GGN one: error against time.

Three cases on scikit-learn's bundled data sets (offline): a regression MLP on ``load_diabetes`` (10-50-50-1
tanh, 300 train / 142 test points), a classification MLP on the 8×8 ``load_digits`` (64-32-32-10 tanh) and a
small CNN on the same images (conv 8 → pool → conv 16 → pool → linear), both 797 train / 1,000 test points.
Each network is trained to a MAP of its Laplace objective (weight decay δ = 1; regression noise σ = 0.5 in
standardized units) in float64; the posterior's prior precision δ (one for all layers) is then chosen post hoc
by the full-GGN Laplace evidence on a log grid, and every structure uses that δ.

The reference is the closed-form GLM predictive of the full-GGN posterior (``FullLaplace``, ``method="glm"``).
Each row is one posterior structure × one predictive method (``ntkgp.laplace.predict``) with its CPU time
at the test points (one thread by default, ``time.process_time``, so that other processes on a shared machine
do not enter; posterior fit not included, fit times are listed separately) and its error: the mean
relative error of the marginal variances, ``mean |v̂ − v| / v`` over test points and outputs, and for
classification the NLPD and the ECE (``ntkgp.metrics``) of its class probabilities (probit for the closed
forms, the average softmax over the method's own samples for the sampling methods).

When ``import laplace`` works (laplace-torch; not an ntkgp dependency) its ``KronLaplace`` and ``DiagLaplace``
GLM predictive (``pred_type="glm"``, probit) run on the same networks and data, and a bias-free copy of the
classification MLP checks that ntkgp's KFAC agrees with laplace-torch's where their conventions match
(laplace-torch keeps weight and bias in separate Kronecker blocks, ntkgp merges them into one ``[W | b]``
block).

    python benchmarks/predictive_estimators.py [--samples 10 100 1000] [--threads 1] [--cases regression mlp cnn] [--quick]
        [--write-docs]

``--write-docs`` writes each case's results into ``docs/predictive.md`` (generated regions
``predictive-estimators-regression``, ``-mlp``, ``-cnn``).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gpytorch
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from map_fit import fit_map  # noqa: E402

from ntkgp._doctable import command_line, write_block  # noqa: E402
from ntkgp.likelihoods import SoftmaxLikelihood, log_likelihood
from ntkgp.metrics import categorical_nlpd, expected_calibration_error
from ntkgp.laplace.weight_space import laplace_posterior
from ntkgp.laplace.weight_space.posterior.predictive_estimators import predict

DTYPE = torch.float64
DELTA = 1.0
SIGMA = 0.5


# ---------------------------------------------------------------------------------------------- cases
def regression_data():
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    x = torch.tensor(data.data, dtype=DTYPE)
    y = torch.tensor(data.target, dtype=DTYPE)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    x = (x - x[:300].mean(0)) / x[:300].std(0)
    y = (y - y[:300].mean()) / y[:300].std()
    return x[:300], y[:300, None], x[300:], y[300:, None]


def digits_data(images: bool):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=DTYPE)
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    if images:
        x = x.reshape(-1, 1, 8, 8)
    return x[:797], y[:797], x[797:], y[797:]


def mlp(sizes: list[int], bias: bool = True) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b, bias=bias))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(DTYPE)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).to(DTYPE)


def train(net: nn.Module, x, y, loss_fn: Callable, steps: int) -> nn.Module:
    """Full-batch Adam on the negative log joint (sum over the data + δ/2 ‖θ‖²), then L-BFGS to a MAP."""

    def objective():
        return loss_fn(net(x), y) + 0.5 * DELTA * sum(p.square().sum() for p in net.parameters())

    return fit_map(net, objective, adam_steps=steps, lbfgs_iterations=200)


def gaussian_loss(f, y):
    return 0.5 * ((f - y) ** 2).sum() / SIGMA**2


def softmax_loss(f, y):
    return nn.functional.cross_entropy(f, y, reduction="sum")


# ---------------------------------------------------------------------------------------------- measuring
def timed(fn: Callable, repeat: int = 1):
    """``fn()`` and its CPU time (``time.process_time``, the minimum over ``repeat`` runs): with one thread it is
    the work done, whatever else runs on the machine."""
    best, out = math.inf, None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return out, best


def variances(prediction) -> torch.Tensor:
    v = prediction.f.variance
    return v.reshape(v.shape[0], -1)


def row(name, method, samples, seconds, var, ref_var, probs=None, y=None) -> dict:
    out = {
        "posterior": name,
        "method": method,
        "S": samples,
        "seconds": seconds,
        "var_rel_err": ((var - ref_var).abs() / ref_var).mean().item(),
    }
    if probs is not None:
        out["nlpd"] = categorical_nlpd(probs, y)
        out["ece"] = expected_calibration_error(probs, y)
    return out


def evidence_prior_precision(posterior, net, x, y, likelihood) -> float:
    r"""The δ (one for all layers) maximising the full-GGN Laplace evidence on a grid, post hoc:
    :math:`\log p(y|f) - \tfrac12 \delta \|\theta^*\|^2 + \tfrac P2 \log\delta - \tfrac12 \log|H + \delta I|`."""
    with torch.no_grad():
        data = log_likelihood(likelihood, net(x), y).sum()
    theta_sq, p = posterior.mean().square().sum(), posterior.num_params
    best = (-math.inf, DELTA)
    for delta in torch.logspace(-2, 3, 21).tolist():
        posterior.prior_precision = delta
        value = (
            data - 0.5 * delta * theta_sq + 0.5 * p * math.log(delta) - 0.5 * posterior.log_det_precision()
        )
        best = max(best, (value.item(), delta))
    posterior.prior_precision = best[1]
    return best[1]


def run_case(title, net, x, y, x_test, y_test, likelihood, classification, samples) -> dict:
    kw = {"prior_structure": "layer", "batch_size": 256}
    link = "probit" if classification else None
    posteriors, fits = {}, {}
    posteriors["full GGN"], fits["full GGN"] = timed(
        lambda: laplace_posterior(net, x, y, likelihood, structure="full_ggn", prior_precision=DELTA, **kw)
    )
    delta = evidence_prior_precision(posteriors["full GGN"], net, x, y, likelihood)
    for label, structure, subset in [
        ("KFAC", "kfac", "all"),
        ("diag GGN", "diag_ggn", "all"),
        ("diag EF", "diag_ef", "all"),
        ("last-layer GGN", "full_ggn", "last_layer"),
    ]:
        posteriors[label], fits[label] = timed(
            lambda s=structure, sub=subset: laplace_posterior(
                net, x, y, likelihood, structure=s, subset=sub, prior_precision=delta, **kw
            )
        )
    for method in ["glm", "glm_mc", "mc_glm", "nn_sampling"]:  # warm-up: one-time costs out of the timings
        for p in posteriors.values():
            predict(p, x_test[:2], method=method, num_samples=2, link=link)
    ref, t_ref = timed(lambda: predict(posteriors["full GGN"], x_test, method="glm", link=link), repeat=2)
    ref_var = variances(ref)
    y_eval = y_test if classification else None
    rows = [row("full GGN", "glm", None, t_ref, ref_var, ref_var, ref.probs, y_eval)]
    if (
        classification
    ):  # the target of the sampling methods' MC link: the exact predictive, MC link, 10^4 draws
        pred, t = timed(
            lambda: predict(
                posteriors["full GGN"],
                x_test,
                method="glm",
                link="mc",
                num_samples=10000,
                generator=torch.Generator().manual_seed(0),
            )
        )
        rows.append(row("full GGN", "glm, MC link", 10000, t, variances(pred), ref_var, pred.probs, y_eval))
    for label in ["KFAC", "diag GGN", "diag EF", "last-layer GGN"]:
        pred, t = timed(lambda p=posteriors[label]: predict(p, x_test, method="glm", link=link), repeat=2)
        rows.append(row(label, "glm", None, t, variances(pred), ref_var, pred.probs, y_eval))
    sample_link = "mc" if classification else None
    for method in ["glm_mc", "mc_glm", "nn_sampling"]:
        for s in samples:
            pred, t = timed(
                lambda m=method, s=s: predict(
                    posteriors["full GGN"],
                    x_test,
                    method=m,
                    num_samples=s,
                    link=sample_link,
                    generator=torch.Generator().manual_seed(0),
                ),
                repeat=2 if s <= 100 else 1,
            )
            rows.append(row("full GGN", method, s, t, variances(pred), ref_var, pred.probs, y_eval))
    pred, t = timed(
        lambda: predict(
            posteriors["full GGN"],
            x_test,
            method="mc_glm",
            num_samples=100,
            link=sample_link,
            finite_difference="forward",
            generator=torch.Generator().manual_seed(0),
        ),
        repeat=2,
    )
    rows.append(row("full GGN", "mc_glm (forward)", 100, t, variances(pred), ref_var, pred.probs, y_eval))
    pred, t = timed(
        lambda: predict(
            posteriors["KFAC"],
            x_test,
            method="glm_mc",
            num_samples=100,
            link=sample_link,
            generator=torch.Generator().manual_seed(0),
        ),
        repeat=2,
    )
    rows.append(row("KFAC", "glm_mc", 100, t, variances(pred), ref_var, pred.probs, y_eval))
    result = {
        "title": title,
        "rows": rows,
        "fits": fits,
        "P": posteriors["full GGN"].num_params,
        "delta": delta,
        "n_test": len(x_test),
        "posteriors": posteriors,
        "ref_var": ref_var,
    }
    if classification:
        with torch.no_grad():
            logits = net(x_test)
        probs = torch.softmax(logits, -1)
        result["map"] = {
            "nlpd": categorical_nlpd(probs, y_test),
            "ece": expected_calibration_error(probs, y_test),
        }
    return result


# ---------------------------------------------------------------------------------------------- laplace-torch
def laplace_available() -> bool:
    try:
        import laplace  # noqa: F401
    except ImportError:
        return False
    return True


LAPLACE_BATCH = 100


def run_laplace_torch(case: dict, net, x, y, x_test, y_test, classification: bool) -> list[dict]:
    """KronLaplace and DiagLaplace GLM predictive of laplace-torch on the same net, data and δ.

    Fitted on batches of ``LAPLACE_BATCH`` and predicting ``LAPLACE_BATCH`` test points per call: its
    Jacobians (``jacrev`` of the whole batch) cost memory and time quadratic in the batch, and a whole
    1,000-point batch needs 13 GB for the CNN. (Its Kronecker factors summed over batches are those of the
    whole data, checked against ntkgp below.)
    """
    from laplace import DiagLaplace as LTDiag
    from laplace import KronLaplace as LTKron

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=LAPLACE_BATCH)
    kind = "classification" if classification else "regression"
    out = []
    for label, cls, ours in [("KronLaplace", LTKron, "KFAC"), ("DiagLaplace", LTDiag, "diag GGN")]:
        kwargs = {"prior_precision": case["delta"]}
        if not classification:
            kwargs["sigma_noise"] = SIGMA
        la, t_fit = timed(lambda c=cls, k=kwargs: _fit(c(net, kind, **k), loader))

        def run(la=la):
            if classification:
                return torch.cat(
                    [la(xc, pred_type="glm", link_approx="probit") for xc in x_test.split(LAPLACE_BATCH)]
                )
            return torch.cat(
                [la(xc, pred_type="glm")[1].reshape(-1, 1) for xc in x_test.split(LAPLACE_BATCH)]
            )

        result, t = timed(run, repeat=2)
        if classification:
            var = torch.cat(
                [
                    la._glm_predictive_distribution(xc)[1].diagonal(dim1=-2, dim2=-1)
                    for xc in x_test.split(LAPLACE_BATCH)
                ]
            )
            probs = result.detach()
        else:
            var, probs = result, None
        r = row(
            f"laplace-torch {label}",
            "glm",
            None,
            t,
            var.detach(),
            case["ref_var"],
            probs,
            y_test if classification else None,
        )
        ours_var = variances(
            predict(case["posteriors"][ours], x_test, link="probit" if classification else None)
        )
        r["fit"] = t_fit
        r["vs_ntkgp"] = ((var.detach() - ours_var).abs() / ours_var).max().item()
        r["ours"] = ours
        out.append(r)
    return out


def _fit(la, loader):
    la.fit(loader)
    return la


def bias_free_agreement(x, y, x_test, delta: float) -> tuple[float, float]:
    """Max relative difference of the KFAC GLM variances, ntkgp vs laplace-torch, on a bias-free MLP (conventions
    match); and the same with biases (they differ: merged vs separate weight/bias blocks)."""
    from laplace import KronLaplace as LTKron

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=LAPLACE_BATCH)
    diffs = []
    for bias in (False, True):
        torch.manual_seed(1)
        net = train(mlp([64, 32, 32, 10], bias=bias), x, y, softmax_loss, 300)
        la = LTKron(net, "classification", prior_precision=delta)
        la.fit(loader)
        theirs = torch.cat([la._glm_predictive_distribution(xc)[1] for xc in x_test.split(LAPLACE_BATCH)])
        post = laplace_posterior(
            net,
            x,
            y,
            SoftmaxLikelihood(10).to(DTYPE),
            structure="kfac",
            prior_precision=delta,
            prior_structure="layer",
        )
        ours = post.glm_covariance(x_test)
        diffs.append(((theirs - ours).abs().max() / ours.abs().max()).item())
    return diffs[0], diffs[1]


# ---------------------------------------------------------------------------------------------- report
REGIONS = {"regression": "predictive-estimators-regression", "mlp": "predictive-estimators-mlp",
           "cnn": "predictive-estimators-cnn"}
DOC = "docs/predictive.md"


def format_case(case: dict, lt_rows: list[dict], extra: str = "") -> str:
    """The case's results as Markdown: sizes, δ and fit times, the table, the laplace-torch comparisons."""
    classification = "map" in case
    lines = []
    fits = ", ".join(f"{k} {v:.2f} s" for k, v in case["fits"].items())
    lines.append(
        f"P = {case['P']}, {case['n_test']} test points. Prior precision δ = {case['delta']:.3g} (the full-GGN "
        f"evidence's best on a grid). Posterior fit (CPU): {fits}.\n"
    )
    head = "| posterior | method | S | CPU time (s) | variance rel. error |"
    sep = "|---|---|---:|---:|---:|"
    if classification:
        head += " NLPD | ECE |"
        sep += "---:|---:|"
    lines += [head, sep]
    for r in case["rows"] + lt_rows:
        s = "" if r["S"] is None else str(r["S"])
        line = f"| {r['posterior']} | {r['method']} | {s} | {r['seconds']:.3f} | {r['var_rel_err']:.3g} |"
        if classification:
            line += f" {r['nlpd']:.4f} | {r['ece']:.4f} |"
        lines.append(line)
    if classification:
        lines.append(
            f"| MAP network (no uncertainty) | | | | | {case['map']['nlpd']:.4f} | {case['map']['ece']:.4f} |"
        )
    for r in lt_rows:
        ours = next(q for q in case["rows"] if q["posterior"] == r["ours"] and q["method"] == "glm")
        lines.append(
            f"\n{r['posterior']}: fit {r['fit']:.2f} s; its variances vs ntkgp {r['ours']}: max rel. diff "
            f"{r['vs_ntkgp']:.2g}; ntkgp's {r['ours']} GLM predictive is {r['seconds'] / ours['seconds']:.1f}x faster"
        )
    if not lt_rows:
        lines.append("\n(laplace-torch was not importable in this run: its rows are absent.)")
    if extra:
        lines.append("\n" + extra)
    return "\n".join(lines)


def print_case(case: dict, lt_rows: list[dict], extra: str = "") -> str:
    text = format_case(case, lt_rows, extra)
    print(f"\n### {case['title']}\n")
    print(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (CPU times are per process)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer training steps (a smoke run)")
    parser.add_argument(
        "--cases", nargs="+", default=["regression", "mlp", "cnn"], choices=["regression", "mlp", "cnn"]
    )
    parser.add_argument("--write-docs", action="store_true",
                        help=f"write each case's results into {DOC} (regions {', '.join(REGIONS.values())})")
    args = parser.parse_args()
    command = command_line()
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(DTYPE)  # laplace-torch's curvlinops backend builds matrices in the default dtype
    steps = 100 if args.quick else 1000
    with_laplace = laplace_available()
    if with_laplace:
        from importlib.metadata import version

        command += f"  # with laplace-torch {version('laplace-torch')} importable"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64; laplace-torch: "
        f"{'yes' if with_laplace else 'not importable, its rows are skipped'}"
    )

    if "regression" in args.cases:
        torch.manual_seed(0)
        x, y, xt, yt = regression_data()
        net = train(mlp([10, 50, 50, 1]), x, y, gaussian_loss, steps)
        lik = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
        lik.noise = SIGMA**2
        case = run_case("Regression MLP, diabetes", net, x, y, xt, yt, lik, False, args.samples)
        text = print_case(case, run_laplace_torch(case, net, x, y, xt, yt, False) if with_laplace else [])
        if args.write_docs:
            write_block(DOC, REGIONS["regression"], text, command.strip())
    for name, images in (("mlp", False), ("cnn", True)):
        if name not in args.cases:
            continue
        x, y, xt, yt = digits_data(images=images)
        torch.manual_seed(0)
        net = train(cnn() if images else mlp([64, 32, 32, 10]), x, y, softmax_loss, steps)
        title = "Small CNN, digits" if images else "Classification MLP, digits"
        case = run_case(title, net, x, y, xt, yt, SoftmaxLikelihood(10).to(DTYPE), True, args.samples)
        lt_rows = run_laplace_torch(case, net, x, y, xt, yt, True) if with_laplace else []
        extra = ""
        if with_laplace and not images:
            free, with_bias = bias_free_agreement(x, y, xt, case["delta"])
            extra = (
                f"KFAC GLM covariance, ntkgp vs laplace-torch KronLaplace, max rel. diff: {free:.2g} without "
                f"biases (same convention), {with_bias:.2g} with biases (ntkgp: one [W | b] block; laplace-torch: "
                "W and b blocks)"
            )
        text = print_case(case, lt_rows, extra)
        if args.write_docs:
            write_block(DOC, REGIONS[name], text, command.strip())


if __name__ == "__main__":
    main()
