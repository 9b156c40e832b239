r"""Out-of-distribution detection: the AUROC of separating two sets of scores."""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import _finite

__all__ = ["ood_auroc"]


def ood_auroc(scores_in: Tensor, scores_out: Tensor) -> float:
    r"""Area under the ROC curve for separating out-of-distribution from in-distribution inputs.

    Scores must be larger for inputs judged more likely out of distribution (e.g.
    :func:`predictive_entropy`; pass the negated maximum probability for a confidence score).
    The AUROC is the Mann–Whitney statistic

    .. math::
        \mathrm{AUROC} = P(s_\text{out} > s_\text{in}) + \tfrac12 P(s_\text{out} = s_\text{in})
            = \frac{R_\text{out} - N_\text{out}(N_\text{out}+1)/2}{N_\text{in} N_\text{out}},

    where :math:`R_\text{out}` is the sum of the ranks of the out-of-distribution scores in the
    pooled sample, tied scores sharing their average rank. Cost: one sort, :math:`O(N \log N)`.

    Args:
        scores_in: ``(N_in,)`` scores of in-distribution inputs.
        scores_out: ``(N_out,)`` scores of out-of-distribution inputs.

    Returns:
        The AUROC in :math:`[0, 1]`.

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: naming the argument, for an empty or non-finite input.

    Example:
        >>> ood_auroc(torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.2]))
        0.875
    """
    if not torch.is_tensor(scores_in) or not torch.is_tensor(scores_out):
        name = "scores_in" if not torch.is_tensor(scores_in) else "scores_out"
        raise TypeError(f"{name} must be a torch.Tensor")
    if scores_in.numel() == 0 or scores_out.numel() == 0:
        raise ValueError("both scores_in and scores_out must be non-empty")
    scores_in = _finite(scores_in, "scores_in").reshape(-1).double()
    scores_out = _finite(scores_out, "scores_out").reshape(-1).double()
    n_in, n_out = scores_in.numel(), scores_out.numel()
    pooled = torch.cat([scores_in, scores_out])
    _, inverse, counts = torch.unique(pooled, sorted=True, return_inverse=True, return_counts=True)
    counts = counts.double()
    last_rank = counts.cumsum(0)
    average_rank = last_rank - (counts - 1) / 2
    rank_sum_out = average_rank[inverse[n_in:]].sum()
    u_statistic = rank_sum_out - n_out * (n_out + 1) / 2
    return (u_statistic / (n_in * n_out)).item()
