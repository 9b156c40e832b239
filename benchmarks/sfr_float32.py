"""float32 SFR against the same SFR on a float64 copy of the network, on Fashion-MNIST with a CNN (issue 27, item 2).

The network is the FSVI paper's CNN (conv 32 and conv 64, 3×3 'same', ReLU, 2×2 max-pool after each, FC 128,
FC 10), trained in float32 with Adam for ``--epochs`` on the first ``--train-images`` training images. Then an SFR
is built in float32 on the first ``--n`` images with ``--m`` random inducing inputs, and the same SFR (the same
weights, exactly, and the same ``Z``) on a float64 copy of the network. Reported for the network and both models:
test accuracy and NLPD (probit predictive) on the first ``--test`` test images, ``inducing_rank`` (per system), build
and prediction times, and the largest differences between the two models' means and variances.

The data are the four idx ``.gz`` files of Fashion-MNIST (``apt-get install dataset-fashion-mnist`` puts them in
``/usr/share/datasets/fashion-mnist/``, the default of ``--data-dir``), read with gzip and numpy.

    python benchmarks/sfr_float32.py [--data-dir DIR] [--n 2000 --m 256 --test 1000] [--coupling independent]
        [--prior-mean linearized] [--write-docs]

``--write-docs`` writes the table into docs/sfr.md (region ``sfr-float32``).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from ntkgp.models import SFRInducingOptions

FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}


def read_idx(path: Path) -> np.ndarray:
    """An idx file (gzip-compressed): magic (two zero bytes, the type code, the number of dimensions), the sizes as
    big-endian 32-bit integers, then the unsigned bytes."""
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    if data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path} is not an idx file of unsigned bytes")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(folder: Path):
    """``(x_train, y_train, x_test, y_test)``: images ``(N, 1, 28, 28)`` in float32, standardized with the training
    set's mean and standard deviation, and integer labels."""
    missing = [name for name in FILES.values() if not (folder / name).exists()]
    if missing:
        raise SystemExit(
            f"Fashion-MNIST not found in {folder} (missing {', '.join(missing)}): install the Debian package "
            "dataset-fashion-mnist, or pass --data-dir with a folder holding the four idx .gz files"
        )
    arrays = {key: read_idx(folder / name) for key, name in FILES.items()}
    x_train = torch.tensor(arrays["x_train"], dtype=torch.float32)[:, None] / 255
    x_test = torch.tensor(arrays["x_test"], dtype=torch.float32)[:, None] / 255
    mean, std = x_train.mean(), x_train.std()
    y_train, y_test = (torch.tensor(arrays[k].astype(np.int64)) for k in ("y_train", "y_test"))
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def train(net: nn.Module, x, y, epochs: int, seed: int, batch: int = 128) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=generator)
        for start in range(0, x.shape[0], batch):
            index = order[start : start + batch]
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[index]), y[index]).backward()
            optimizer.step()
    return net.eval()


def scores(probs: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Accuracy and NLPD (mean negative log probability of the label)."""
    probs = probs.double()
    accuracy = (probs.argmax(-1) == labels).double().mean().item()
    nlpd = -probs[torch.arange(labels.shape[0]), labels].clamp_min(1e-300).log().mean().item()
    return accuracy, nlpd


def build_and_predict(net, x, y, x_test, dtype, args, inducing_points=None):
    kw = {"num_inducing": args.m} if inducing_points is None else {"inducing_points": inducing_points}
    start = time.perf_counter()
    sfr = SFR(net, x.to(dtype), y, SoftmaxLikelihood(10).to(dtype), prior_precision=args.prior_precision,
              prior_mean=args.prior_mean, output_coupling=args.coupling,
              inducing=SFRInducingOptions(seed=args.seed), **kw)
    rank = sfr.inducing_rank
    built = time.perf_counter()
    with torch.no_grad():
        dist = sfr(x_test.to(dtype))
        mean, variance = dist.mean.double(), dist.variance.double()
        probs = sfr.likelihood(dist).probs
    return sfr, rank, mean, variance, probs, built - start, time.perf_counter() - built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--train-images", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--coupling", default="independent", choices=["independent", "joint"])
    parser.add_argument("--prior-mean", default="linearized", choices=["linearized", "zero"])
    parser.add_argument("--prior-precision", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/sfr.md")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = fashion_mnist(args.data_dir)
    x_test, y_test = x_test[: args.test], y_test[: args.test]
    start = time.perf_counter()
    net = train(cnn(), x_train[: args.train_images], y_train[: args.train_images], args.epochs, args.seed)
    trained = time.perf_counter() - start
    with torch.no_grad():
        net_acc, net_nlpd = scores(torch.softmax(net(x_test), -1), y_test)
    print(f"network: trained in {trained:.0f} s, test accuracy {net_acc:.4f}, NLPD {net_nlpd:.4f}", flush=True)

    x, y = x_train[: args.n], y_train[: args.n]
    results = {}
    for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        model = net if dtype == torch.float32 else copy.deepcopy(net).double()  # the same weights, exactly
        z = None if dtype == torch.float32 else results["float32"][0].inducing_points.double()
        results[name] = build_and_predict(model, x, y, x_test, dtype, args, z)
        _, rank, _, _, probs, build_s, predict_s = results[name]
        acc, nlpd = scores(probs, y_test)
        print(f"SFR {name}: rank {int(rank.min())}-{int(rank.max())}, accuracy {acc:.4f}, NLPD {nlpd:.4f}, "
              f"build {build_s:.0f} s, predict {predict_s:.0f} s", flush=True)
    (_, _, m32, v32, p32, *_), (_, _, m64, v64, p64, *_) = results["float32"], results["float64"]
    mean_diff = (m32 - m64).abs().max().item() / m64.abs().max().item()
    var_diff = ((v32 - v64).abs() / v64).max().item()
    print(f"float32 vs float64: largest mean difference {mean_diff:.1e} (relative to the largest mean), "
          f"largest relative variance difference {var_diff:.1e}")

    if args.write_docs:
        from ntkgp._doctable import command_line, markdown_table, write_block

        rows = [["network (float32)", f"{net_acc:.4f}", f"{net_nlpd:.4f}", "", "", ""]]
        for name in ("float32", "float64"):
            _, rank, _, _, probs, build_s, predict_s = results[name]
            acc, nlpd = scores(probs, y_test)
            rows.append([f"SFR, {name} network", f"{acc:.4f}", f"{nlpd:.4f}", f"{int(rank.min())}–{int(rank.max())}",
                         f"{build_s:.0f}", f"{predict_s:.0f}"])
        systems = args.m if args.coupling == "independent" else args.m * 10
        content = markdown_table(["model", "test accuracy", "NLPD", "inducing_rank", "build s", "predict s"], rows)
        content += (
            f"\n\nFashion-MNIST, the CNN above trained {args.epochs} epoch(s) on {args.train_images} images; SFR on "
            f"N = {args.n}, M = {args.m} ({systems} directions per system, {args.coupling} outputs, "
            f"{args.prior_mean} prior mean, δ = {args.prior_precision:g}), {args.test} test images; the float64 row "
            f"is the same model on a float64 copy of the network with the same Z. Largest mean difference "
            f"{mean_diff:.1e} (relative to the largest mean), largest relative variance difference {var_diff:.1e}; "
            f"`torch.get_num_threads() = {torch.get_num_threads()}`."
        )
        write_block("docs/sfr.md", "sfr-float32", content, command_line())


if __name__ == "__main__":
    main()
