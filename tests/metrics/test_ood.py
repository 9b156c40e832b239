import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from ntkgp.metrics import ood_auroc

# OOD AUROC


def test_ood_auroc_matches_sklearn_with_ties():
    generator = torch.Generator().manual_seed(8)
    # Rounded scores produce many ties, exercising the average-rank rule.
    scores_in = torch.round(2 * torch.randn(137, generator=generator))
    scores_out = torch.round(2 * torch.randn(91, generator=generator) + 1)
    labels = np.r_[np.zeros(137), np.ones(91)]
    expected = roc_auc_score(labels, np.r_[scores_in.numpy(), scores_out.numpy()])
    assert ood_auroc(scores_in, scores_out) == pytest.approx(expected, rel=1e-12)


def test_ood_auroc_extremes():
    low, high = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 0.9])
    assert ood_auroc(low, high) == 1.0
    assert ood_auroc(high, low) == 0.0
    assert ood_auroc(torch.ones(4), torch.ones(3)) == 0.5


def test_ood_auroc_hand_example():
    # Pairs (out > in): 2 -> beats 1 (1 pair, ties with 2 count 1/2); 3 -> beats 1, 2 (2 pairs).
    scores_in, scores_out = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 3.0])
    assert ood_auroc(scores_in, scores_out) == pytest.approx((1 + 0.5 + 2) / 4)


def test_ood_auroc_rejects_empty():
    with pytest.raises(ValueError):
        ood_auroc(torch.tensor([]), torch.tensor([1.0]))
