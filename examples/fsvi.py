"""FSVI for the whole network against MAP, the Laplace GLM predictive (NTKGP) and SFR, on three problems.

* **1-D regression with a gap** (``ntkgp.datasets.gap_regression``, 60 points, noise 0.1): 2×50 ReLU network,
  prior precision 1/fan-in per layer (δ = 1, 50, 50), fixed noise variance 0.01. Test targets: the noise-free
  function on the grid [-1.5, 1.5] plus fresh noise. Also reported: the mean predictive standard deviation of f
  in the middle of the gap (|x| < 0.2) over the one on the data (0.45 < |x| < 0.9). FSVI's context points are
  uniform on [-2, 2], a box that covers every input the model is asked about (the training inputs span only
  [-0.93, 1.00]): the KL pulls the variational distribution towards the prior only where there are context
  points, so with the box of the training inputs FSVI is as confident as MAP outside it (test NLPD 5.9
  instead of 1.0 on seed 0, 1,000 steps each). MAP trains for 1,000 full-batch steps (longer makes NTKGP and SFR,
  built on it, overconfident in the gap), FSVI for 3,000 (its standard deviations start at 1e-3 and grow slowly).
* **Two moons** (``ntkgp.datasets.two_moons``, 100 training and 1000 test points, noise 0.2): 2×32 ReLU
  network, δ = 1 for every layer.
* **Digits** (scikit-learn's bundled 8×8 digits, offline; 1200 training and 597 test images): a small CNN
  (conv 3×3 → ReLU → max-pool → linear), δ = 1. FSVI takes half its context points from the mini-batch and half
  from random monochrome images. Out-of-distribution detection by predictive entropy: test digits rotated by
  90°, and uniform-noise images (AUROC). The Laplace GLM predictive is left out here: its dense
  ``(N·C)²`` = 12,000² Gram does not fit the purpose of a quick example.

MAP is trained with Adam on the negative log joint (likelihood plus the same Gaussian prior), NTKGP and SFR
linearize the MAP network with the same prior precisions; FSVI (``ntkgp.fsvi.train_fsvi``) starts from the same
initial weights as MAP and trains a mean-field Gaussian over all weights for the same number of steps (except
on the gap regression, see above). FSVI's
predictive is Monte Carlo over weights (200 draws; "FSVI"), and the linearized GP ("FSVI-lin"); "FSVI, diagonal
KL" is the same training with ``kl_covariance="diagonal"`` (every context output independent, as FSVI's public
code computes the KL), Monte Carlo predictive. Times are
training (MAP: the network; NTKGP/SFR: building the model on top of the MAP network) plus prediction.

Writes ``fsvi_gap_regression.png`` (predictive bands) and ``fsvi_two_moons.png`` (predictive entropy) to
``--output-dir``. ``--quick`` runs a few steps of everything (a smoke test, not the table of docs/fsvi.md).

    python examples/fsvi.py [--quick] [--output-dir examples-output] [--seed 0] [--write-docs]

``--write-docs`` writes the table into the region ``EXAMPLE_TABLE`` of docs/fsvi.md (with ``--quick``, marked
as the smoke-test settings).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from gpytorch.likelihoods import GaussianLikelihood
from torch import nn

from ntkgp import NTKGP, SFR, metrics, plotting
from ntkgp._doctable import command_line, write_block
from ntkgp.datasets import gap_regression, two_moons
from ntkgp.fsvi import BatchMixedContext, FSVIOptimization, FSVIOptions, MonochromeContext, train_fsvi, UniformBoxContext
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood, log_likelihood

DOC, REGION = "docs/fsvi.md", "EXAMPLE_TABLE"
DIAGONAL = "FSVI, diagonal KL"  # kl_covariance="diagonal" (the KL of FSVI's public code), Monte Carlo predictive
HEADERS = ["problem", "model", "NLPD", "accuracy", "ECE", "std gap/data", "AUROC rot90", "AUROC noise", "time s"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("examples-output"))
    parser.add_argument("--quick", action="store_true", help="a few steps of everything (smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {DOC} ({REGION})")
    return parser.parse_args()


def relu_mlp(d_in: int, width: int, d_out: int, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, d_out)).double()


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.head = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.max_pool2d(torch.relu(self.conv(x)), 2).flatten(1))


def small_cnn(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SmallCNN().double()


def train_map(net, x, y, likelihood, precisions, epochs, batch_size, lr, seed) -> float:
    """Adam on −log p(y|f(x;θ)) − log p(θ), per-layer precisions; returns the seconds."""
    layers = [m for m in net.modules() if list(m.parameters(recurse=False))]  # one precision per layer
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    start = time.perf_counter()
    n = x.shape[0]
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for s in range(0, n, batch_size):
            idx = order[s: s + batch_size]
            opt.zero_grad()
            nll = -log_likelihood(likelihood, net(x[idx]), y[idx]).sum() * (n / len(idx))
            prior = sum(0.5 * d * p.square().sum() for d, m in zip(precisions.tolist(), layers) for p in m.parameters())
            (nll + prior).backward()
            opt.step()
    return time.perf_counter() - start


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def gap_problem(args, rows) -> None:
    epochs, fsvi_epochs = (60, 60) if args.quick else (1000, 3000)
    data = gap_regression(n=60, noise_std=0.1, seed=args.seed)
    noise = 0.01
    y_test = data.f_test + 0.1 * torch.randn(data.f_test.shape, generator=torch.Generator().manual_seed(1),
                                             dtype=torch.float64)
    x_mid = torch.linspace(-1, 1, 41, dtype=torch.float64)[:, None]
    gap = x_mid.abs().squeeze() < 0.2
    on_data = ((x_mid.abs() > 0.45) & (x_mid.abs() < 0.9)).squeeze()
    precisions = torch.tensor([1.0, 50.0, 50.0], dtype=torch.float64)

    def likelihood():
        lik = GaussianLikelihood().double()
        lik.noise = noise
        return lik

    net = relu_mlp(1, 50, 1, args.seed)
    seconds_map = train_map(net, data.x_train, data.y_train, likelihood(), precisions, epochs, 60, 1e-2, args.seed)
    net.eval()
    predictives = {}  # name -> (function mean, function std on the test grid, std ratio, seconds)
    with torch.no_grad():
        f = net(data.x_test).squeeze(-1)
    predictives["MAP"] = (f, torch.zeros_like(f), None, seconds_map)
    for name, build in (("NTKGP (Laplace)", lambda: NTKGP(net, data.x_train, data.y_train, likelihood(),
                                                          prior_precision=precisions)),
                        ("SFR", lambda: SFR(net, data.x_train, data.y_train, likelihood(), num_inducing=20,
                                            prior_precision=precisions))):
        model, seconds = timed(build)
        model.eval()
        with torch.no_grad():
            (dist, mid), more = timed(lambda model=model: (model(data.x_test), model(x_mid)))
        predictives[name] = (dist.mean, dist.variance.sqrt(),
                             (mid.variance.sqrt()[gap].mean() / mid.variance.sqrt()[on_data].mean()).item(),
                             seconds + more)
    for name, kl_covariance in (("FSVI", "full"), (DIAGONAL, "diagonal")):
        result = train_fsvi(relu_mlp(1, 50, 1, args.seed), data.x_train, data.y_train, likelihood(),
                            context=UniformBoxContext(torch.tensor([-2.0], dtype=torch.float64),
                                                      torch.tensor([2.0], dtype=torch.float64)),
                            prior_precision=precisions, epochs=fsvi_epochs, batch_size=None, lr=1e-2, num_context=32,
                            options=FSVIOptions(context_jitter=1e-6, kl_covariance=kl_covariance),
                            optimization=FSVIOptimization(seed=args.seed), progress=False)
        model = result.model
        with torch.no_grad():
            (mc, lin, mid), more = timed(lambda model=model: (
                model.predict(data.x_test, num_samples=200, generator=torch.Generator().manual_seed(2)),
                model(data.x_test), model(x_mid)))
        ratio = (mid.variance.sqrt()[gap].mean() / mid.variance.sqrt()[on_data].mean()).item()
        mc_std = (mc.variance - noise).clamp_min(0).sqrt()
        predictives[name] = (mc.mean, mc_std, ratio, result.seconds + more)
        if kl_covariance == "full":
            predictives["FSVI-lin"] = (lin.mean, lin.variance.sqrt(), ratio, result.seconds + more)

    fig, axes = plotting.new_figure(1, len(predictives))
    for ax, (name, (mean, std, ratio, seconds)) in zip(axes[0], predictives.items()):
        nlpd = metrics.gaussian_nlpd(mean, std.square() + noise, y_test.squeeze(-1))
        rows.append(["gap regression", name, nlpd, None, None, ratio, None, None, seconds])
        plotting.plot_regression(ax, data.x_test, mean, (std.square() + noise).sqrt(), x_train=data.x_train,
                                 y_train=data.y_train, title=f"{name}: NLPD {nlpd:.2f}")
    print("figure:", plotting.save_figure(fig, args.output_dir / "fsvi_gap_regression.png"))


def moons_problem(args, rows) -> None:
    epochs = 60 if args.quick else 1000
    x, y = two_moons(n=100, noise=0.2, seed=args.seed)
    x_test, y_test = two_moons(n=1000, noise=0.2, seed=args.seed + 100)
    precisions = torch.ones(3, dtype=torch.float64)
    net = relu_mlp(2, 32, 1, args.seed)
    seconds_map = train_map(net, x, y, LogisticLikelihood().double(), precisions, epochs, 100, 1e-2, args.seed)
    net.eval()
    grid = plotting.grid_2d(x, resolution=40 if args.quick else 80, margin=0.3)
    probs = {}
    with torch.no_grad():
        probs["MAP"] = ((torch.sigmoid(net(x_test)).squeeze(-1), torch.sigmoid(net(grid.points)).squeeze(-1)),
                        seconds_map)
    for name, build in (("NTKGP (Laplace)", lambda: NTKGP(net, x, y, LogisticLikelihood().double(),
                                                          prior_precision=precisions)),
                        ("SFR", lambda: SFR(net, x, y, LogisticLikelihood().double(), num_inducing=30,
                                            prior_precision=precisions))):
        model, seconds = timed(build)
        model.eval()
        with torch.no_grad():
            value, more = timed(lambda model=model: tuple(model.likelihood(model(t)).probs
                                                          for t in (x_test, grid.points)))
        probs[name] = (value, seconds + more)
    for name, kl_covariance in (("FSVI", "full"), (DIAGONAL, "diagonal")):
        result = train_fsvi(relu_mlp(2, 32, 1, args.seed), x, y, LogisticLikelihood().double(), prior_precision=1.0,
                            epochs=epochs, batch_size=None, lr=1e-2, num_context=32,
                            options=FSVIOptions(kl_covariance=kl_covariance),
                            optimization=FSVIOptimization(seed=args.seed),
                            progress=False)
        model = result.model
        with torch.no_grad():
            value, more = timed(lambda model=model: tuple(
                model.predict(t, num_samples=200, generator=torch.Generator().manual_seed(2)).probs
                for t in (x_test, grid.points)))
            probs[name] = (value, result.seconds + more)
            if kl_covariance == "full":
                value, more = timed(lambda model=model: tuple(model.predict(t, method="linearized").probs
                                                              for t in (x_test, grid.points)))
                probs["FSVI-lin"] = (value, result.seconds + more)
    fig, axes = plotting.new_figure(1, len(probs))
    for ax, (name, ((p_test, p_grid), seconds)) in zip(axes[0], probs.items()):
        nlpd = metrics.categorical_nlpd(p_test, y_test)
        rows.append(["two moons", name, nlpd, metrics.accuracy(p_test, y_test),
                     metrics.expected_calibration_error(p_test, y_test), None, None, None, seconds])
        plotting.plot_uncertainty_map(ax, grid, p_grid, x=x, y=y, title=f"{name}: NLPD {nlpd:.3f}")
    print("figure:", plotting.save_figure(fig, args.output_dir / "fsvi_two_moons.png"))


def digits_problem(args, rows) -> None:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("digits: skipped (needs scikit-learn, the 'examples' extra)")
        return
    epochs = 1 if args.quick else 30
    images, labels = load_digits(return_X_y=True)
    x_all = torch.tensor(images, dtype=torch.float64).reshape(-1, 1, 8, 8) / 16.0
    y_all = torch.tensor(labels)
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(args.seed))
    train, test = order[:1200], order[1200:]
    if args.quick:
        train, test = train[:200], test[:100]
    x, y, x_test, y_test = x_all[train], y_all[train], x_all[test], y_all[test]
    x_rot = torch.rot90(x_test, 1, dims=(2, 3))
    x_noise = torch.rand(x_test.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    precisions = torch.ones(2, dtype=torch.float64)
    net = small_cnn(args.seed)
    seconds_map = train_map(net, x, y, SoftmaxLikelihood(10).double(), precisions, epochs, 64, 1e-2, args.seed)
    net.eval()
    predictives = {}
    with torch.no_grad():
        predictives["MAP"] = (lambda t: torch.softmax(net(t), -1), seconds_map)
    sfr, seconds = timed(lambda: SFR(net, x, y, SoftmaxLikelihood(10).double(), num_inducing=min(100, len(y)),
                                     prior_precision=precisions, output_coupling="independent"))
    sfr.eval()
    predictives["SFR"] = (lambda t: sfr.likelihood(sfr(t)).probs, seconds)
    context = BatchMixedContext(MonochromeContext.from_data(x), fraction=0.5)
    for name, kl_covariance in (("FSVI", "full"), (DIAGONAL, "diagonal")):
        result = train_fsvi(small_cnn(args.seed), x, y, SoftmaxLikelihood(10).double(), context=context,
                            prior_precision=1.0, epochs=epochs, batch_size=64, lr=1e-2, num_context=32,
                            options=FSVIOptions(kl_covariance=kl_covariance),
                            optimization=FSVIOptimization(seed=args.seed), progress=False)
        model = result.model
        predictives[name] = (lambda t, model=model: model.predict(
            t, num_samples=100, generator=torch.Generator().manual_seed(2)).probs, result.seconds)
        if kl_covariance == "full":
            predictives["FSVI-lin"] = (lambda t, model=model: model.predict(t, method="linearized").probs,
                                       result.seconds)
    for name, (predict, seconds) in predictives.items():
        with torch.no_grad():
            (p_test, p_rot, p_noise), more = timed(lambda predict=predict: tuple(predict(t) for t in (x_test, x_rot, x_noise)))
        h_in = metrics.predictive_entropy(p_test)
        rows.append(["digits (CNN)", name, metrics.categorical_nlpd(p_test, y_test), metrics.accuracy(p_test, y_test),
                     metrics.expected_calibration_error(p_test, y_test), None,
                     metrics.ood_auroc(h_in, metrics.predictive_entropy(p_rot)),
                     metrics.ood_auroc(h_in, metrics.predictive_entropy(p_noise)), seconds + more])


def format_table(headers, rows) -> str:
    cells = [headers] + [["-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    rows: list[list] = []
    start = time.perf_counter()
    for problem in (gap_problem, moons_problem, digits_problem):
        problem(args, rows)
    table = format_table(HEADERS, rows)
    print(table)
    print(f"total time: {time.perf_counter() - start:.0f} s")
    if args.write_docs:
        note = ("With `--quick` (a smoke test: 60 steps for the 1-D problems, one epoch on 200 digits; the models "
                "are not converged, so the numbers show that everything runs, not how the methods compare).\n\n"
                if args.quick else "")
        print("wrote", write_block(DOC, REGION, note + table, command_line()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
