"""SFR's prior mean and δ on the Fashion-MNIST CNN: the GP mean and the network's mean, with the sparse evidence.

A trained ReLU network is nearly positively homogeneous in its weights, so ``J(x)θ* ≈ L·f(x)`` (``L`` weight layers)
and the linearized prior mean ``f(x) − J(x)θ*`` points against the network. This run measures that on test images
(``‖J θ*‖ / ‖f‖`` and the cosine of ``f − Jθ*`` with ``f``, from one Jacobian-vector product), then builds SFR with
each prior mean on the first ``--n`` training images (``--m`` inducing points, independent outputs, float32 network)
and, for each δ of ``--deltas``, reports the test accuracy and NLPD of the GP mean (``predictive_mean="gp"``) and
of the network's mean (``"nn"``), both with the probit predictive, and the sparse evidence (untimed).

    python benchmarks/sfr_prior_mean.py --weights WEIGHTS.pt [--data-dir DATA] [--n 2000] [--m 256] [--n-test 1000]
        [--write-docs]

``WEIGHTS.pt``: a state dict of ``benchmarks/image_scale.py``'s CNN (that script trains and keeps one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import image_scale  # noqa: E402  (the CNN)


def homogeneity(net: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """``‖J θ*‖ / ‖f‖`` and the cosine of ``f − J θ*`` with ``f`` over the images ``x``."""
    params = {k: v.detach() for k, v in net.named_parameters()}

    def f(p):
        return torch.func.functional_call(net, p, (x,))

    out, jvp = torch.func.jvp(f, (params,), (params,))
    mean = out - jvp
    return (jvp.norm() / out.norm()).item(), (torch.sum(mean * out) / (mean.norm() * out.norm())).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--deltas", type=float, nargs="+", default=[1.0, 10.0, 100.0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--write-docs", action="store_true", help="write the table into docs/sfr.md")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import ntkgp
    from ntkgp._doctable import command_line, markdown_table, write_block
    from ntkgp.datasets import load_fashion_mnist
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.metrics import accuracy, categorical_nlpd

    x, y, xt, yt = load_fashion_mnist(args.data_dir)
    x, y, xt, yt = x[: args.n], y[: args.n], xt[: args.n_test], yt[: args.n_test]
    net = image_scale.cnn()
    net.load_state_dict(torch.load(args.weights))
    net.eval()
    with torch.no_grad():
        net_probs = torch.cat([net(c) for c in xt.split(500)]).double().softmax(-1)
    ratio, cosine = homogeneity(net, xt[:200])
    rows = []
    for prior_mean in ("linearized", "zero"):
        sfr = ntkgp.SFR(net, x, y, SoftmaxLikelihood(10), num_inducing=args.m, prior_precision=args.deltas[0],
                        prior_structure="network", output_coupling="independent", prior_mean=prior_mean)
        sfr.eval()
        for delta in args.deltas:
            sfr.covar_module.prior_precision = delta
            cells = [f"{prior_mean}, {delta:g}"]
            for mean in ("gp", "nn"):
                sfr.predictive_mean = mean
                with torch.no_grad():
                    probs = torch.cat([sfr.likelihood(sfr(c)).probs for c in xt.split(500)]).double()
                cells.append(f"{100 * accuracy(probs, yt):.1f} %, {categorical_nlpd(probs, yt):.3f}")
            sfr.predictive_mean = "gp"
            with torch.no_grad():
                cells.append(f"{sfr.log_marginal_likelihood().item():,.0f}".replace("-", "−"))
            rows.append(cells)
            print(" | ".join(cells), flush=True)
    header = ["prior mean, δ", "GP mean: accuracy, NLPD", '`predictive_mean="nn"`: accuracy, NLPD', "sparse evidence"]
    note = (f"The network: {100 * accuracy(net_probs, yt):.1f} %, NLPD {categorical_nlpd(net_probs, yt):.3f} on the "
            f"{len(yt):,} test images; SFR on the first {len(y):,} training images, M = {args.m}, independent outputs, "
            f"float32 network. On 200 test images `‖J θ*‖ / ‖f‖ = {ratio:.2f}` and the cosine of `f − Jθ*` with `f` "
            f"is {cosine:.4f}.")
    print(note)
    if args.write_docs:
        write_block("docs/sfr.md", "sfr-prior-mean", markdown_table(header, rows) + "\n\n" + note, command_line())


if __name__ == "__main__":
    main()
