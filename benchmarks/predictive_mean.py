"""Which mean should NTKGP's predictive have? ``predictive_mean="nn"`` (f(x*)) against ``"gp"`` (one Newton step).

Usage::

    python benchmarks/predictive_mean.py [--seeds 3] [--quick] [--write-docs]

For small regression and classification sets (generated, or bundled with scikit-learn, so nothing is
downloaded) and several seeds (a random 70/30 split and a network initialisation per seed):

1. a MAP network is trained full batch with Adam on the mean loss ``−(1/N) Σ log p(y|f) + δ₀/(2N) ‖θ‖²``
   (weight decay δ₀/N; regression: Gaussian loss with a fixed σ₀);
2. two NTKGPs are built on it, one for each value of ``predictive_mean``, with two choices of the
   hyperparameters: **MAP** — the network's own prior δ₀ (and σ₀), under which θ* is (nearly) stationary so
   the two means nearly agree; **evidence** — δ per layer (and σ²) learned by the Laplace-GGN evidence
   after training (the library's documented workflow), under which θ* is no longer stationary;
3. the test NLPD (per point; regression on standardized targets, classification with the probit link) and
   the accuracy (classification) of both are printed, with standard errors over seeds, and the difference
   ``gp − nn`` paired by seed.

``--write-docs`` writes the table into the region ``predictive-mean`` of docs/ntkgp.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import gpytorch
import torch

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.likelihoods import SoftmaxLikelihood

DOC = "docs/ntkgp.md"
REGION = "predictive-mean"
SIGMA0 = 0.1  # the fixed noise of the regression MAP loss (standardized targets)
DELTA0 = 1.0  # the prior precision of the MAP loss (weight decay δ₀/N)


def _standardize(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = train.mean(0), train.std(0).clamp_min(1e-12)
    return (train - mean) / std, (test - mean) / std


def _split(x: torch.Tensor, y: torch.Tensor, seed: int, standardize_y: bool):
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(x.shape[0], generator=generator)
    n_train = int(0.7 * x.shape[0])
    tr, te = perm[:n_train], perm[n_train:]
    x_train, x_test = _standardize(x[tr], x[te])
    y_train, y_test = y[tr], y[te]
    if standardize_y:
        y_train, y_test = _standardize(y_train, y_test)
    return x_train, y_train, x_test, y_test


def load(name: str, seed: int):
    """``(x_train, y_train, x_test, y_test, C, task)`` in float64."""
    if name == "gap (1-D)":
        data = ntkgp.datasets.gap_regression(n=140, seed=seed, noise_std=0.1)
        x, y = data.x_train, data.y_train.squeeze(-1)
        return (*_split(x, y, seed, True), 1, "regression")
    if name == "two moons":
        x, y = ntkgp.datasets.two_moons(n=300, noise=0.25, seed=seed)
        return (*_split(x, y, seed, False), 2, "classification")
    import sklearn.datasets as skd

    loader = {"diabetes": skd.load_diabetes, "breast cancer": skd.load_breast_cancer, "wine": skd.load_wine}[name]
    bunch = loader()
    x = torch.as_tensor(bunch.data, dtype=torch.float64)
    if name == "diabetes":
        y = torch.as_tensor(bunch.target, dtype=torch.float64)
        return (*_split(x, y, seed, True), 1, "regression")
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    return (*_split(x, y, seed, False), int(y.max()) + 1, "classification")


def train_map(x, y, c, task, seed, steps):
    torch.manual_seed(seed)
    d = x.shape[1]
    net = torch.nn.Sequential(
        torch.nn.Linear(d, 50), torch.nn.Tanh(), torch.nn.Linear(50, c)
    ).double()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    n = x.shape[0]
    for _ in range(steps):
        optimizer.zero_grad()
        f = net(x)
        if task == "regression":
            nll = ((f.squeeze(-1) - y) ** 2).sum() / (2 * SIGMA0**2)
        else:
            nll = torch.nn.functional.cross_entropy(f, y, reduction="sum")
        reg = 0.5 * DELTA0 * sum((p**2).sum() for p in net.parameters())
        ((nll + reg) / n).backward()
        optimizer.step()
    return net.eval()


def build(net, x, y, c, task, hyper, steps):
    """Both models, with shared hyperparameters: MAP (δ₀, σ₀) or learned by the evidence."""
    if task == "regression":
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        likelihood.noise = SIGMA0**2
    else:
        likelihood = SoftmaxLikelihood(num_classes=c).double()
    model = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=DELTA0, predictive_mean="gp")
    if hyper == "evidence":
        mll = ntkgp.LaplaceGGNMarginalLogLikelihood(likelihood, model)
        optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.1)
        model.train()
        for _ in range(steps):
            optimizer.zero_grad()
            (-mll(model(x), y)).backward()
            optimizer.step()
    return model.eval()


def scores(model, x_test, y_test, task):
    """(NLPD per point, accuracy or None) of the model's predictive over y."""
    with torch.no_grad():
        if task == "regression":
            pred = model.likelihood(model(x_test))
            nlpd = -torch.distributions.Normal(pred.mean, pred.variance.sqrt()).log_prob(y_test).mean()
            return nlpd.item(), None
        probs = model.likelihood(model(x_test)).probs
        nlpd = -probs.gather(-1, y_test[:, None]).clamp_min(1e-300).log().mean()
        return nlpd.item(), (probs.argmax(-1) == y_test).double().mean().item()


def mean_se(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    se = t.std().item() / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return t.mean().item(), se


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 seeds, shorter training")
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOC} ({REGION})")
    args = parser.parse_args(argv)
    seeds = 2 if args.quick else args.seeds
    map_steps, evidence_steps = (300, 30) if args.quick else (1500, 200)
    torch.set_num_threads(1)  # the measurement machine is shared; one thread is steadier
    datasets = ["gap (1-D)", "diabetes", "two moons", "breast cancer", "wine"]
    rows, start = [], time.perf_counter()
    for name in datasets:
        results = {h: {"nn": [], "gp": [], "acc_nn": [], "acc_gp": []} for h in ("MAP", "evidence")}
        for seed in range(seeds):
            x, y, x_test, y_test, c, task = load(name, seed)
            t0 = time.perf_counter()
            net = train_map(x, y, c, task, seed, map_steps)
            print(f"  {name} seed {seed}: MAP {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            for hyper in ("MAP", "evidence"):
                model = build(net, x, y, c, task, hyper, evidence_steps)
                for choice in ("nn", "gp"):
                    model.predictive_mean = choice
                    nlpd, acc = scores(model, x_test, y_test, task)
                    results[hyper][choice].append(nlpd)
                    if acc is not None:
                        results[hyper][f"acc_{choice}"].append(acc)
        for hyper, r in results.items():
            nn_m, nn_s = mean_se(r["nn"])
            gp_m, gp_s = mean_se(r["gp"])
            d_m, d_s = mean_se([g - n for g, n in zip(r["gp"], r["nn"])])
            acc = (f"{mean_se(r['acc_nn'])[0]:.3f} / {mean_se(r['acc_gp'])[0]:.3f}" if r["acc_nn"] else "–")
            rows.append([name, f"{x.shape[0]}", hyper, f"{nn_m:.3f} ± {nn_s:.3f}", f"{gp_m:.3f} ± {gp_s:.3f}",
                         f"{d_m:+.3f} ± {d_s:.3f}", acc])
            print(" | ".join(rows[-1]), flush=True)
    seconds = time.perf_counter() - start
    table = markdown_table(
        ["data", "N train", "δ (σ²)", "NLPD `\"nn\"`", "NLPD `\"gp\"`", "gp − nn (paired)", "accuracy nn / gp"], rows
    )
    settings = (
        f"MLP d-50-C tanh, float64, MAP by {map_steps} full-batch Adam steps (lr 1e-2, δ₀ = {DELTA0}, "
        f"regression σ₀ = {SIGMA0}); evidence: {evidence_steps} Adam steps (lr 0.1) on δ per layer (and σ²); "
        f"random 70/30 splits, {seeds} seeds (mean ± standard error); probit link; {seconds:.0f} s in all"
    )
    print(settings)
    if args.write_docs:
        print("wrote", write_block(DOC, REGION, f"{settings}.\n\n{table}", command_line()))


if __name__ == "__main__":
    main()
