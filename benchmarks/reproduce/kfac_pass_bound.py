"""A measured lower bound of an exact KFAC-GGN pass on the FMNIST MLP of ``marglik_images.py``: one forward and
C = 10 backward passes (the rows of every image's output Jacobian, which the GGN's C - 1 = 9 nonzero softmax-Hessian
directions need) over ``--n-train`` images in batches of 128, in CPU seconds of this process, beside one forward and
one backward (the gradient work of an epoch of MAP steps). The best of 3 after a warm-up.

    python benchmarks/reproduce/kfac_pass_bound.py --n-train 2000 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

import _images


def passes(net, x, backward: int) -> float:
    params = list(net.parameters())
    start = time.process_time()
    for xb in x.split(128):
        out = net(xb)
        for c in range(backward):
            torch.autograd.grad(out[:, c].sum(), params, retain_graph=c < backward - 1)
    return time.process_time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    x, _, _, _ = _images.load(argparse.Namespace(data_dir=args.data_dir, n_train=args.n_train, n_test=None,
                                                  device="cpu", mnist=None))
    net = _images.immer_mlp()
    passes(net, x, 1)  # warm-up
    one, ten = (min(passes(net, x, k) for _ in range(3)) for k in (1, 10))
    print(f"forward + 1 backward over {len(x)} images: {one:.2f} s CPU; forward + 10 backward: {ten:.2f} s CPU")


if __name__ == "__main__":
    main()
