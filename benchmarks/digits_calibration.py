"""When the GLM predictive is under-confident, and what the prior precision δ does about it: scikit-learn's digits.

The 8×8 ``load_digits`` (1,797 images, C = 10), split once, stratified (seed 0): N = 1,257 training images
(70 %), 270 for validation, 270 for test. A tanh MLP 64-32-10 (P = 2,410) in float64 is trained to the MAP
of ``Σ_n CE_n + δ/2 ‖θ‖²`` at the training δ = 1 (full-batch Adam, 1,000 steps of 0.01, then L-BFGS to the
mode). Rows, each scored on the test images (NLPD, ECE with 10 bins, accuracy):

- the network's own softmax;
- ``NTKGP`` (the GLM predictive, probit link) at the training δ;
- ``NTKGP`` at the δ that maximizes its Laplace-GGN evidence, θ* fixed (100 Adam steps of 0.1 on log δ);
- the GLM predictive at each δ of a grid, with the network's own mean (``FullLaplace`` GGN posterior and
  ``ntkgp.laplace.predict``; ``NTKGP(predictive_mean="nn")`` gives the same), with the evidence and the
  validation NLPD of each: the δ that validation would choose;
- ``NTKGP`` with its default mean at a δ of the grid other than the training δ (its mean is then the
  linearized model's posterior mean, not the network's);
- Algorithm 1 (``ntkgp.training.train_marglik`` with the demo's settings: δ learned by the evidence while
  training), one δ for the network, and with ``--per-layer`` also one δ per layer: the network and its NTKGP.

    python benchmarks/digits_calibration.py [--per-layer] [--write-docs]

``--write-docs`` writes the table into the generated regions ``digits-calibration`` of docs/predictive.md and
docs/ntkgp.md. About eight minutes on a 2-core machine (``--per-layer``: about fifteen more); the table's
note gives the wall time of the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from ntkgp.training import HyperparameterSchedule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from map_fit import fit_map  # noqa: E402

import ntkgp  # noqa: E402
from ntkgp import metrics  # noqa: E402
from ntkgp._doctable import command_line, markdown_table, write_block  # noqa: E402
from ntkgp.likelihoods import SoftmaxLikelihood  # noqa: E402
from ntkgp.laplace.weight_space import laplace_posterior  # noqa: E402
from ntkgp.laplace.weight_space.posterior.predictive_estimators import predict  # noqa: E402

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


def ntkgp_row(name: str, model: ntkgp.NTKGP, delta: str, val: tuple, test: tuple) -> list[str]:
    return [name, delta, f"{evidence_per_datum(model):.4f}",
            f"{metrics.categorical_nlpd(ntkgp_probs(model, val[0]), val[1]):.4f}",
            *scores(ntkgp_probs(model, test[0]), test[1])]


def network_row(name: str, net: nn.Module, val: tuple, test: tuple) -> list[str]:
    with torch.no_grad():
        return [name, "-", "-", f"{metrics.categorical_nlpd(net(val[0]).softmax(-1), val[1]):.4f}",
                *scores(net(test[0]).softmax(-1), test[1])]


def algorithm_1_rows(train: tuple, val: tuple, test: tuple, prior_structure: str) -> list[list[str]]:
    """Algorithm 1 (``train_marglik``, the demo's settings): the network and its NTKGP, δ learned online."""
    from ntkgp.training import train_marglik

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()
    likelihood = SoftmaxLikelihood(num_classes=10).double()
    result = train_marglik(net, *train, likelihood, structure="full_ggn", prior_structure=prior_structure,
                           epochs=1000, lr=1e-2,
                           schedule=HyperparameterSchedule(burn_in=100, frequency=100, hyper_steps=50),
                           progress=False)
    which = "one δ" if prior_structure == "network" else "δ per layer"
    delta = ", ".join(f"{d:.3g}" for d in result.prior_precision.tolist())
    return [network_row(f"Algorithm 1 ({which} learned in training): network", net, val, test),
            ntkgp_row(f"Algorithm 1 ({which} learned in training): NTKGP", result.model(*train), delta, val, test)]


def run(per_layer: bool = False) -> str:
    start = time.perf_counter()
    train, val, test = digits()
    net = train_map(*train, TRAINING_DELTA)
    likelihood = SoftmaxLikelihood(num_classes=10).double()
    header = ["predictive", "δ", "evidence/N", "validation NLPD", "test NLPD", "test ECE", "test accuracy"]
    rows = [network_row("network (softmax of f(x; θ*))", net, val, test)]
    model = ntkgp.NTKGP(net, *train, likelihood, prior_precision=TRAINING_DELTA, prior_structure="network")
    rows.append(ntkgp_row("NTKGP, training δ", model, f"{TRAINING_DELTA:g}", val, test))
    model.optimize_prior_precision()  # δ by the evidence, θ* fixed (100 Adam steps of 0.1 on raw δ)
    model.eval()
    rows.append(ntkgp_row("NTKGP, δ by the evidence (θ* fixed)", model,
                          f"{model.covar_module.prior_precision.item():.3g}", val, test))
    for row in rows:
        print(row, flush=True)

    posterior = laplace_posterior(net, *train, likelihood, structure="full_ggn", prior_precision=TRAINING_DELTA,
                                  prior_structure="network")
    grid_rows = []
    for delta in GRID:
        posterior.prior_precision = torch.tensor([delta], dtype=torch.float64)
        model.covar_module.prior_precision = torch.tensor([delta], dtype=torch.float64)
        with torch.no_grad():
            nlpd_val = metrics.categorical_nlpd(predict(posterior, val[0]).probs, val[1])
            grid_rows.append(["GLM with the network's mean", f"{delta:g}", f"{evidence_per_datum(model):.4f}",
                              f"{nlpd_val:.4f}", *scores(predict(posterior, test[0]).probs, test[1])])
        print(grid_rows[-1], flush=True)
    chosen = min(range(len(GRID)), key=lambda i: float(grid_rows[i][3]))
    grid_rows[chosen][0] += " (best validation NLPD)"
    rows += grid_rows
    collapse = GRID[2]  # NTKGP's default mean at a δ away from the training δ
    model.covar_module.prior_precision = torch.tensor([collapse], dtype=torch.float64)
    rows.append(ntkgp_row('NTKGP, predictive_mean="gp" (default), δ not the training δ', model, f"{collapse:g}",
                          val, test))
    print(rows[-1], flush=True)
    for structure in ("network", "layer") if per_layer else ("network",):
        rows += algorithm_1_rows(train, val, test, structure)
        print(*rows[-2:], sep="\n", flush=True)
    seconds = time.perf_counter() - start
    note = (f"\n\nN = {len(train[0])} training, {len(val[0])} validation, {len(test[0])} test images; P = "
            f"{sum(p.numel() for p in net.parameters())}; training δ = {TRAINING_DELTA:g} (weight decay of the MAP "
            "fit); every GLM row uses the probit link; evidence/N is NTKGP's Laplace-GGN evidence at that δ and "
            f"θ* (the weights it was trained at). Wall time {seconds:.0f} s.")
    return markdown_table(header, rows) + note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help=f"write the table into {' and '.join(DOCS)}")
    parser.add_argument("--per-layer", action="store_true",
                        help="also Algorithm 1 with one δ per layer (about fifteen more minutes on 2 cores)")
    args = parser.parse_args()
    table = run(args.per_layer)
    print(table)
    if args.write_docs:
        for doc in DOCS:
            write_block(doc, REGION, table, command_line())


if __name__ == "__main__":
    main()
