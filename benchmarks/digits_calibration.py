"""When the GLM predictive is under-confident, and what the prior precision δ does about it: scikit-learn's digits.

The 8×8 ``load_digits`` (1,797 images, C = 10), split once, stratified (seed 0): N = 1,257 training images
(70 %), 270 for validation, 270 for test. A tanh MLP 64-32-10 (P = 2,410) in float64 is trained to the MAP
of ``Σ_n CE_n + δ/2 ‖θ‖²`` at the training δ = 1 (full-batch Adam, 1,000 steps of 0.01, then L-BFGS to the
mode). Rows, each scored on the test images (NLPD, ECE with 10 bins, accuracy):

- the network's own softmax;
- ``NTKGP`` (the GLM predictive, probit link) at the training δ;
- ``NTKGP`` at the δ that maximizes its Laplace-GGN evidence, θ* fixed (100 Adam steps of 0.1 on log δ);
- the GLM predictive at each δ of a grid, with the network's own mean (``FullLaplace`` GGN posterior and
  ``ntkgp.predictive.predict``; ``NTKGP(predictive_mean="nn")`` gives the same), with the evidence and the
  validation NLPD of each: the δ that validation would choose.

    python benchmarks/digits_calibration.py [--write-docs]

``--write-docs`` writes the table into the generated regions ``digits-calibration`` of docs/predictive.md and
docs/ntkgp.md. About a minute on one core.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from map_fit import fit_map  # noqa: E402

import ntkgp  # noqa: E402
from ntkgp import metrics  # noqa: E402
from ntkgp._doctable import command_line, markdown_table, write_block  # noqa: E402
from ntkgp.likelihoods import SoftmaxLikelihood  # noqa: E402
from ntkgp.posteriors import laplace_posterior  # noqa: E402
from ntkgp.predictive import predict  # noqa: E402

DOCS = ("docs/predictive.md", "docs/ntkgp.md")
REGION = "digits-calibration"
TRAINING_DELTA = 1.0
GRID = (1.0, 3.0, 10.0, 30.0, 100.0, 1000.0)


def digits(seed: int = 0):
    """Train / validation / test tensors (pixels / 16), stratified 70 / 15 / 15 %."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_rest, y_train, y_rest = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    x_val, x_test, y_val, y_test = train_test_split(x_rest, y_rest, test_size=0.5, random_state=seed,
                                                    stratify=y_rest)
    as_x = lambda a: torch.tensor(a / 16.0, dtype=torch.float64)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return (as_x(x_train), as_y(y_train)), (as_x(x_val), as_y(y_val)), (as_x(x_test), as_y(y_test))


def train_map(x: torch.Tensor, y: torch.Tensor, delta: float, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()

    def objective() -> torch.Tensor:
        penalty = sum((p**2).sum() for p in net.parameters())
        return (nn.functional.cross_entropy(net(x), y, reduction="sum") + 0.5 * delta * penalty) / len(x)

    return fit_map(net, objective, adam_steps=1000, lbfgs_iterations=200)


def scores(probs: torch.Tensor, y: torch.Tensor) -> list[str]:
    return [f"{metrics.categorical_nlpd(probs, y):.4f}", f"{metrics.expected_calibration_error(probs, y):.4f}",
            f"{metrics.accuracy(probs, y):.4f}"]


def ntkgp_probs(model: ntkgp.NTKGP, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.likelihood(model.eval()(x)).probs


def evidence_per_datum(model: ntkgp.NTKGP) -> float:
    with torch.no_grad():
        return model.log_marginal_likelihood().item() / model.num_data


def maximize_evidence(model: ntkgp.NTKGP, steps: int = 100, lr: float = 0.1) -> ntkgp.NTKGP:
    """Adam on ``-model.log_marginal_likelihood()`` over the (log-parameterized) prior precision, θ* fixed."""
    raw = model.covar_module.raw_prior_precision
    optimizer = torch.optim.Adam([raw], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        (-model.log_marginal_likelihood()).backward()
        optimizer.step()
    raw.grad = None
    return model


def run() -> tuple[list[list[str]], str]:
    start = time.perf_counter()
    (x, y), (x_val, y_val), (x_test, y_test) = digits()
    net = train_map(x, y, TRAINING_DELTA)
    likelihood = SoftmaxLikelihood(num_classes=10).double()
    header = ["predictive", "δ", "evidence/N", "validation NLPD", "test NLPD", "test ECE", "test accuracy"]
    with torch.no_grad():
        rows = [["network (softmax of f(x; θ*))", "-", "-", f"{metrics.categorical_nlpd(net(x_val).softmax(-1), y_val):.4f}",
                 *scores(net(x_test).softmax(-1), y_test)]]
    print(rows[-1], flush=True)

    model = ntkgp.NTKGP(net, x, y, likelihood, prior_precision=TRAINING_DELTA, prior_structure="network")
    rows.append(["NTKGP, training δ", f"{TRAINING_DELTA:g}", f"{evidence_per_datum(model):.4f}",
                 f"{metrics.categorical_nlpd(ntkgp_probs(model, x_val), y_val):.4f}",
                 *scores(ntkgp_probs(model, x_test), y_test)])
    print(rows[-1], flush=True)
    maximize_evidence(model.train())
    best_delta = model.covar_module.prior_precision.item()
    rows.append(["NTKGP, δ by the evidence (θ* fixed)", f"{best_delta:.3g}", f"{evidence_per_datum(model):.4f}",
                 f"{metrics.categorical_nlpd(ntkgp_probs(model, x_val), y_val):.4f}",
                 *scores(ntkgp_probs(model, x_test), y_test)])
    print(rows[-1], flush=True)

    posterior = laplace_posterior(net, x, y, likelihood, structure="full_ggn", prior_precision=TRAINING_DELTA,
                                  prior_structure="network")
    grid_rows = []
    for delta in GRID:
        posterior.prior_precision = torch.tensor([delta], dtype=torch.float64)
        model.covar_module.prior_precision = torch.tensor([delta], dtype=torch.float64)
        with torch.no_grad():
            val = metrics.categorical_nlpd(predict(posterior, x_val).probs, y_val)
            test = scores(predict(posterior, x_test).probs, y_test)
        grid_rows.append(["GLM, network's mean", f"{delta:g}", f"{evidence_per_datum(model):.4f}", f"{val:.4f}",
                          *test])
        print(grid_rows[-1], flush=True)
    chosen = min(range(len(GRID)), key=lambda i: float(grid_rows[i][3]))
    grid_rows[chosen][0] += " (best validation NLPD)"
    rows += grid_rows
    seconds = time.perf_counter() - start
    note = (f"\n\nN = {len(x)} training, {len(x_val)} validation, {len(x_test)} test images; P = "
            f"{sum(p.numel() for p in net.parameters())}; training δ = {TRAINING_DELTA:g}; the GLM rows use the "
            f"probit link; evidence/N is NTKGP's Laplace-GGN evidence at that δ (θ* fixed). Wall time {seconds:.0f} s.")
    return rows, markdown_table(header, rows) + note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {' and '.join(DOCS)}")
    args = parser.parse_args()
    _, table = run()
    print(table)
    if args.write_docs:
        for doc in DOCS:
            write_block(doc, REGION, table, command_line())


if __name__ == "__main__":
    main()
