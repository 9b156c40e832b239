"""The one-node evidence of the diagonal spectra (ntkgp.laplace.weight_space.structured_evidence) for every layout
of the groups (one group, which broadcasts; consecutive runs; groups out of order; interleaved), value and first
derivatives against the formula written in plain torch and differentiated by autograd."""

import pytest
import torch

from ntkgp.laplace.weight_space.structured_evidence import structured_evidence


def reference(delta, scale, u, groups, power, norms, sizes, stats):
    s = scale.reshape(())
    alpha, beta, gamma = stats[:, 0]
    terms = s**power * u + delta[groups]
    return (alpha + beta * s.log() + gamma * s - (delta * norms).sum() / 2 + (sizes * delta.log()).sum() / 2
            - terms.log().sum() / 2)


LAYOUTS = {
    "one group": [40],
    "consecutive runs": [7, 20, 13],
    "out of order": [7, 20, 13],  # group ids permuted: 2, 0, 1
    "interleaved": [5, 5, 5, 5],  # groups 0, 1, 0, 1
    "many groups": [3] * 12,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("power", [1, 2])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_value_and_gradients_against_autograd(name, power, dtype):
    g = torch.Generator().manual_seed(0)
    lengths = LAYOUTS[name]
    ids = {"out of order": [2, 0, 1], "interleaved": [0, 1, 0, 1]}.get(name, list(range(len(lengths))))
    groups = torch.repeat_interleave(torch.tensor(ids), torch.tensor(lengths))
    num_groups = max(ids) + 1
    p = groups.shape[0]
    u = torch.rand(p, generator=g, dtype=torch.float64).to(dtype) * 3
    u[::4] = 0  # eigenvalues at zero: the prior alone
    norms = torch.rand(num_groups, generator=g, dtype=torch.float64).to(dtype)
    sizes = torch.bincount(groups, minlength=num_groups).to(dtype)
    stats = torch.tensor([[-1.3], [50.0], [-7.5]], dtype=dtype)
    delta0 = torch.rand(num_groups, generator=g, dtype=torch.float64).to(dtype) + 0.2
    scale0 = torch.tensor([0.7], dtype=dtype)
    values, grads = [], []
    for fn in (structured_evidence, reference):
        delta, scale = delta0.clone().requires_grad_(), scale0.clone().requires_grad_()
        value = fn(delta, scale, u, groups, power, norms, sizes, stats)
        values.append(value.detach())
        grads.append(torch.autograd.grad(value, [delta, scale]))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    (value, expected), ((gd, gs), (ed, es)) = values, grads
    assert value.dtype == dtype and torch.allclose(value, expected, rtol=tol, atol=0)
    assert torch.allclose(gd, ed, rtol=tol, atol=tol) and torch.allclose(gs, es, rtol=tol)
