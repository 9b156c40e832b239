"""A small transformer classifier on integer token sequences: MAP against KFAC Laplace, NTKGP and SFR, with OOD
detection, beside laplace-torch where it runs.

The task needs attention: each sequence of ``--seq-len`` tokens holds filler tokens and two different *marker*
tokens (of ``C`` markers, ``--classes``) at random positions; the class is the marker that comes **first**. Which
markers a sequence holds says nothing about which came first (a bag of tokens is right half of the time), so the
network must compare positions. Out-of-distribution sequences are made of tokens from a held-out quarter of the
vocabulary that no training sequence contains (their embeddings are never trained).

The network (float32): ``nn.Embedding`` of width ``d`` (``--width``) plus learned positions, a 2-layer
``nn.TransformerEncoder`` (``batch_first``, 2 heads, feed-forward 2d, no dropout), mean pooling over the sequence
and a linear layer to the ``C`` classes; the inputs are the integer token ids themselves (``long``), in every
method. It is trained with Adam on the negative log joint (softmax likelihood, Gaussian prior of precision δ on
every weight). Then:

* **MAP** — the network's own softmax;
* **KFAC** — :func:`ntkgp.laplace.laplace_posterior` with ``structure="kfac"`` (a Kronecker block per
  ``nn.Linear``, the other parameters — embedding, positions, attention projections, LayerNorm — exact diagonal),
  δ per layer by the evidence, GLM predictive with the probit link;
* **NTKGP** — the GLM predictive as an exact GP (:class:`ntkgp.NTKGP`) on ``--n-gp`` training sequences,
  probit link;
* **SFR** — :class:`ntkgp.SFR` on all training sequences with ``M`` inducing sequences (``--num-inducing``)
  chosen from the data, probit link;
* **laplace-torch** (when ``import laplace`` works) — ``Laplace(..., hessian_structure="kron")`` for all weights
  and for the last layer; what it refuses is printed with its error.

NTKGP and SFR use the prior precisions the KFAC evidence chose (the same per-layer groups). The table reports
test NLL, accuracy, ECE, the AUROC of telling OOD sequences from test sequences by predictive entropy, and the
seconds of each method (MAP: training; the others: building, and predicting the test and OOD sequences). A
figure of the entropy histograms goes to ``--output-dir``.

    python examples/transformer_tokens.py [--quick] [--n-train 2000] [--n-test 1000] [--epochs 8]
        [--classes 4] [--seq-len 10] [--vocab 32] [--width 32] [--n-gp 500] [--num-inducing 256]

``--quick``: 1,000 training sequences, 5 epochs, 300 test sequences, NTKGP on 200, M = 64 (about two minutes on
two cores).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import Tensor, nn

import ntkgp
from _uncertainty import Report, laplace_torch_rows, plot_entropies, train_map
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models import SFRInducingOptions
from ntkgp.laplace import PassOptions


def marker_sequences(n: int, classes: int, seq_len: int, vocab: int, seed: int,
                     out_of_distribution: bool = False) -> tuple[Tensor, Tensor]:
    """``n`` sequences ``(n, seq_len)`` of token ids and their classes ``(n,)`` (module docstring): markers are
    the ids ``0 … classes-1``, filler the ids up to ``vocab - vocab // 4``; out of distribution, only the held-out
    ids ``vocab - vocab // 4 … vocab-1`` (the labels are then meaningless)."""
    g = torch.Generator().manual_seed(seed)
    held_out = vocab - vocab // 4
    if out_of_distribution:
        return torch.randint(held_out, vocab, (n, seq_len), generator=g), torch.zeros(n, dtype=torch.long)
    x = torch.randint(classes, held_out, (n, seq_len), generator=g)
    markers = torch.rand(n, classes, generator=g).argsort(1)[:, :2]  # two different markers
    positions = torch.rand(n, seq_len, generator=g).argsort(1)[:, :2].sort(1).values  # two positions, in order
    x.scatter_(1, positions, markers)
    return x, markers[:, 0]


class TokenClassifier(nn.Module):
    """Embedding plus learned positions, a ``layers``-layer ``nn.TransformerEncoder``, mean pooling, linear."""

    def __init__(self, vocab: int, seq_len: int, classes: int, width: int = 32, heads: int = 2, layers: int = 2,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.positions).mean(1))


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 training sequences, 5 epochs, 300 test")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--n-gp", type=int, default=500, help="training sequences of the NTKGP (exact GP)")
    parser.add_argument("--num-inducing", type=int, default=256)
    parser.add_argument("--prior-precision", type=float, default=1.0)
    parser.add_argument("--no-laplace-torch", action="store_true", help="skip laplace-torch even if importable")
    parser.add_argument("--output-dir", type=Path, default=Path("examples-output"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("n_train", "n_test", "epochs", "n_gp", "num_inducing"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.classes < 2 or args.seq_len < 2:
        parser.error("--classes and --seq-len must be >= 2 (two different markers per sequence)")
    if args.width % 2:
        parser.error("--width must be even (two attention heads)")
    if args.vocab - args.vocab // 4 <= args.classes or args.vocab < 4:
        parser.error("--vocab must leave filler tokens beside the --classes markers and a held-out quarter")
    if args.quick:
        args.n_train, args.n_test, args.epochs = min(args.n_train, 1000), min(args.n_test, 300), min(args.epochs, 5)
        args.n_gp, args.num_inducing = min(args.n_gp, 200), min(args.num_inducing, 64)
    shape = (args.classes, args.seq_len, args.vocab)
    x_tr, y_tr = marker_sequences(args.n_train, *shape, seed=args.seed)
    x_te, y_te = marker_sequences(args.n_test, *shape, seed=args.seed + 1)
    x_ood, _ = marker_sequences(args.n_test, *shape, seed=args.seed + 2, out_of_distribution=True)
    delta, classes = args.prior_precision, args.classes
    net = TokenClassifier(args.vocab, args.seq_len, classes, args.width, seed=args.seed)
    print(f"data: which of {classes} markers comes first, {args.seq_len} tokens of a vocabulary of {args.vocab} "
          f"({args.n_train} training, {args.n_test} test sequences; OOD: the held-out {args.vocab // 4} tokens)")
    print(f"network: transformer encoder, 2 layers, width {args.width}, "
          f"P = {sum(p.numel() for p in net.parameters()):,}; {args.epochs} epochs")
    report = Report(x_te, y_te, x_ood)

    seconds = train_map(net, x_tr, y_tr, delta, args.epochs, args.seed, lr=3e-3, batch_size=64)
    report.add("MAP", lambda x: net(x).softmax(-1), seconds)

    start = time.perf_counter()
    posterior = ntkgp.laplace.laplace_posterior(net, x_tr, y_tr, SoftmaxLikelihood(num_classes=classes),
                                                structure="kfac", prior_precision=delta, options=PassOptions(progress=False))
    chosen = posterior.optimize_prior_precision(method="evidence").detach()
    report.add("KFAC", lambda x: posterior.predict(x, link="probit").probs, time.perf_counter() - start)

    start = time.perf_counter()
    gp = ntkgp.NTKGP(net, x_tr[: args.n_gp], y_tr[: args.n_gp], SoftmaxLikelihood(num_classes=classes),
                     prior_precision=chosen)
    gp.eval()
    if tuple(gp.covar_module.group_names) != tuple(posterior.groups.group_names):  # δ is one value per group
        raise RuntimeError(f"NTKGP's prior groups {gp.covar_module.group_names} differ from KFAC's "
                           f"{posterior.groups.group_names}")
    report.add(f"NTKGP (N = {min(args.n_gp, args.n_train)})", lambda x: gp.likelihood(gp(x)).probs,
               time.perf_counter() - start)

    start = time.perf_counter()
    sfr = ntkgp.SFR(net, x_tr, y_tr, SoftmaxLikelihood(num_classes=classes),
                    num_inducing=min(args.num_inducing, args.n_train), prior_precision=chosen,
                    inducing=SFRInducingOptions(seed=args.seed),
                    progress=False)
    sfr.eval()
    report.add(f"SFR (M = {sfr.num_inducing})", lambda x: sfr.likelihood(sfr(x)).probs, time.perf_counter() - start)

    notes = [] if args.no_laplace_torch else laplace_torch_rows(report, net, x_tr, y_tr)
    print(report.table() + "\n")
    for line in notes:
        print(line)
    path = args.output_dir / "transformer_tokens_entropy.png"
    plot_entropies(report.entropies, classes, "test (in)", path)
    return report.rows


if __name__ == "__main__":
    main()
