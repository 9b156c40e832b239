"""Reference helpers of the metric tests: seeded probabilities and labels, and a brute-force ECE."""

import numpy as np
import torch


def random_probs(n: int, c: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(n, c, generator=generator, dtype=torch.float64), dim=-1)


def random_labels(n: int, c: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(c, (n,), generator=torch.Generator().manual_seed(seed))


def brute_force_ece(probs: np.ndarray, y: np.ndarray, num_bins: int) -> float:
    total = 0.0
    n = len(y)
    for b in range(num_bins):
        lo, hi = b / num_bins, (b + 1) / num_bins
        members = [i for i in range(n) if lo < probs[i].max() <= hi]
        if not members:
            continue
        acc = sum(int(probs[i].argmax() == y[i]) for i in members) / len(members)
        conf = sum(probs[i].max() for i in members) / len(members)
        total += len(members) / n * abs(acc - conf)
    return total
