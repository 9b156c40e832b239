"""Algorithm 1 and SFR data-parallel over several processes (``torch.distributed``), each holding a shard.

Every rank generates the same synthetic 3-class data set (three noisy spiral arms, no download), keeps its
contiguous shard (``ntkgp.distributed.shard``) and makes the same calls with ``distributed=True``:

1. ``train_marglik``: MAP training with the gradients summed over the ranks (as DistributedDataParallel)
   and the per-layer prior precisions learned by the KFAC evidence, whose sums over the data are
   all-reduced;
2. ``SFR``: the dual statistics of every rank's shard, all-reduced: every rank holds the SFR model of all
   the data (the inducing inputs are the ones one process would choose);
3. ``SFR.update``: each rank adds its shard of held-back data.

Rank 0 prints test accuracy, test NLL and the sparse log marginal likelihood; every rank prints the
checksum of its statistics (the same on all ranks). Launch with

    torchrun --nproc_per_node=2 examples/distributed_sfr.py            # CPUs: gloo
    torchrun --nproc_per_node=NUM_GPUS examples/distributed_sfr.py     # one GPU per rank: nccl

(``python examples/distributed_sfr.py`` runs it in one process.) Several hosts: add ``--nnodes``,
``--node_rank`` and ``--rdzv_endpoint`` to ``torchrun`` (docs/scaling.md, "Several processes and GPUs").
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

from ntkgp.distributed import rank, shard, world_size
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.models.sfr import SFR
from ntkgp.training import HyperparameterSchedule, train_marglik

from _common import format_table, mlp
from ntkgp.models import SFRInducingOptions


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-train", type=int, default=2000, help="training points, all ranks (default: 2000)")
    parser.add_argument("--num-inducing", type=int, default=64, help="M, inducing inputs (default: 64)")
    parser.add_argument("--epochs", type=int, default=300, help="epochs of Algorithm 1 (default: 300)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def spirals(n: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points on three noisy spiral arms in 2-D, labels 0, 1, 2 (the same on every rank for a seed)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    r = torch.rand(n, generator=g, dtype=dtype) * 2 + 0.2
    angle = r * 2.0 + y.to(dtype) * 2 * math.pi / 3 + 0.2 * torch.randn(n, generator=g, dtype=dtype)
    return torch.stack([r * torch.cos(angle), r * torch.sin(angle)], -1), y


def start() -> torch.device:
    """Join the process group torchrun describes (or a one-process group); nccl with GPUs, gloo otherwise."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def main() -> None:
    args = parse_args()
    device = start()
    me, world = rank(), world_size()
    x, y = spirals(args.num_train, args.seed)
    x_test, y_test = spirals(1000, args.seed + 1)
    x, y, x_test, y_test = (t.to(device) for t in (x, y, x_test, y_test))
    held_back = args.num_train // 5  # arrives later, through SFR.update
    x_train, y_train = shard(x[held_back:], y[held_back:])
    x_new, y_new = shard(x[:held_back], y[:held_back])

    net = mlp(2, 3, width=32, depth=2, seed=args.seed).to(device)  # the same weights on every rank
    likelihood = SoftmaxLikelihood(num_classes=3).to(device=device, dtype=torch.float64)
    started = time.perf_counter()
    result = train_marglik(
        net, x_train, y_train, likelihood, structure="kfac", epochs=args.epochs, lr=1e-2,
        schedule=HyperparameterSchedule(burn_in=args.epochs // 3, frequency=args.epochs // 3, hyper_steps=50),
        progress=me == 0, distributed=True,
    )
    trained = time.perf_counter()
    net.eval()
    sfr = SFR(net, x_train, y_train, likelihood, num_inducing=args.num_inducing, prior_precision=result.prior_precision,
              inducing=SFRInducingOptions(seed=args.seed), distributed=True)
    built = time.perf_counter()
    sfr.update(x_new, y_new)
    updated = time.perf_counter()

    with torch.no_grad():
        probs = sfr.likelihood(sfr(x_test)).probs
        evidence = sfr.log_marginal_likelihood().item() / sfr.num_data
    accuracy = (probs.argmax(-1) == y_test).double().mean().item()
    nll = -probs.gather(-1, y_test[:, None]).clamp_min(1e-300).log().mean().item()
    checksum = sum(float(b.double().sum()) for b in (sfr.dual_statistics.precision, sfr.dual_statistics.residual))
    print(f"rank {me}/{world}: {x_train.shape[0] + x_new.shape[0]} of {sfr.num_data} points here, "
          f"statistics checksum {checksum:.12e}", flush=True)
    dist.barrier()
    if me == 0:
        print(f"\nbackend {dist.get_backend()}, {world} rank(s), device {device}")
        print(format_table(
            ["N", "M", "delta (per layer)", "test accuracy", "test NLL", "log ML / N", "train s", "SFR s", "update s"],
            [[sfr.num_data, sfr.num_inducing, ", ".join(f"{v:.3g}" for v in result.prior_precision.tolist()), accuracy,
              nll, evidence, trained - started, built - trained, updated - built]],
        ))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
