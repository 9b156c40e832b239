"""Measured lower bounds beside the rows of ``benchmarks/evidence_routes.py``: what a step or a build cannot go below.

- :func:`per_step`: the CPU time of one step, the mean over at least ``steps`` steps and at least
  ``MIN_SECONDS`` of CPU time after one warm-up step (a step of half a millisecond timed three times is noise);
  :func:`alternating_steps`: two libraries' steps timed in alternation, the median of several rounds.
- :func:`floor_step`: an Adam step on the row's hyperparameters (``G`` log δ and, for regression, a log noise)
  after the backward pass of a one-operation graph: what no hyperparameter step can avoid.
- :func:`bare_structured_step`: the floor's step plus the ``O(P)`` kernels of the KFAC / diagonal evidence
  ``α + β log s + γ s − ½ δ·‖θ‖² + ½ Σ P_g log δ_g − ½ Σ log(s u_p + δ_g(p))`` and its first derivatives, run outside
  autograd on the curvature's own stored numbers (eigenvalues ``u``, groups): the shifted eigenvalues, their
  reciprocals and logarithms and the sums.
- :func:`bare_full_step`: the dense kernels of an exact step on a matrix of the row's side ``R``: one Cholesky
  factorization and one triangular inverse (the diagonal of the inverse, ``R³/3`` multiply-adds in all; with
  several Grams instead ``B⁻¹`` from the factor, ``torch.cholesky_inverse``, and their inner products), plus the floor; with one δ the spectral form
  ``Σ log1p(ρ λ_i)`` with autograd plus the Adam step.
- :func:`bare_low_rank_step`: the several-δ weight-space step when one parameter group holds most of the
  parameters (ntkgp's Schur route): ``O(P_b k² + k³)`` kernels of the same sizes, plus the floor.
- :func:`bare_full_build`: the Gram of an ``(N·C) × P`` matrix (the least arithmetic that forms the NTK Gram, or
  the GGN of a network with other layers) or, for a network of ``Linear`` layers in weight space, one product per
  pair of layers from their features (``N·P_l·P_m`` multiply-adds, the diagonal blocks over symmetric pairs only),
  and, in weight space, the eigenvalues (one δ) or one Cholesky factorization (the first evidence).
- :func:`bare_kfac_build` (one output, MLPs of ``Linear`` and ``Tanh``): one forward pass, one backward pass, the
  Kronecker factors ``[a, 1]ᵀ[a, 1]`` and ``gᵀg`` of every layer, their eigenvalues and the first evidence.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from ntkgp.linalg import gram, triangular_inverse

MIN_SECONDS = 0.3
MAX_STEPS = 5000
ROUND_LIMIT = 0.025  # seconds: a step this long or longer is timed in one round


def per_step(step, steps: int) -> float:
    """Mean CPU seconds of ``step()`` over at least ``steps`` calls and ``MIN_SECONDS`` (one warm-up call first),
    with the garbage of earlier work collected first and the collector paused while timing (as ``timeit`` does:
    a collection of another row's tensors would land on this one)."""
    step()
    count, total = 0, 0.0
    with quiet_collector():
        while (count < steps or total < MIN_SECONDS) and count < MAX_STEPS:
            start = time.process_time()
            step()
            total += time.process_time() - start
            count += 1
    return total / count


def alternating_steps(ours, theirs, steps: int, first: tuple[float, float], rounds: int = 5
                      ) -> tuple[float, float]:
    """:func:`per_step` of two steps timed in alternation (``ours``, ``theirs``, ``ours``, …) for ``rounds``
    rounds, and the median of each side's rounds: both sides under the same state of a shared machine, which a
    single timing of each, minutes apart, is not. Where either step took ``ROUND_LIMIT`` or more in its ``first``
    timing (seconds, ours and theirs), those timings are returned as they are."""
    if max(first) >= ROUND_LIMIT:
        return first
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in zip((ours, theirs), times):
            out.append(per_step(fn, steps))
    return statistics.median(times[0]), statistics.median(times[1])


def warm_torch() -> None:
    """torch's one-time lazy imports, untimed, before either library is timed: the first forward-mode product
    imports ``torch._decomp.decompositions_for_jvp``, which scripts a dozen functions with TorchScript (about 0.2 s
    of CPU), and the first ``autograd.grad`` with a given cotangent imports ``torch.fx``'s symbolic shapes; either
    would land on whichever side first takes that path."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    out = net(x)
    torch.autograd.grad(out, x, torch.ones_like(out))
    params = dict(net.named_parameters())
    tangents = {name: torch.ones_like(value) for name, value in params.items()}
    torch.func.jvp(lambda p: torch.func.functional_call(net, p, (x.detach(),)), (params,), (tangents,))
    torch.func.vmap(torch.func.jacrev(lambda p, xi: torch.func.functional_call(net, p, (xi,))),
                    in_dims=(None, 0))(params, x.detach())


@contextlib.contextmanager
def quiet_collector():
    """Collect the garbage now, then pause the cyclic collector until the block ends."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _adam(num_groups: int, regression: bool):
    log_delta = torch.zeros(num_groups, dtype=torch.float64, requires_grad=True)
    log_s = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    params = [log_delta, log_s] if regression else [log_delta]
    return log_delta, log_s, torch.optim.Adam(params, lr=1e-3)


def floor_step(num_groups: int, regression: bool, steps: int) -> float:
    log_delta, log_s, opt = _adam(num_groups, regression)

    def step():
        opt.zero_grad()
        (log_delta.exp().sum() + log_s.sum() if regression else log_delta.exp().sum()).backward()
        opt.step()

    return per_step(step, steps)


def bare_structured_step(curvature, likelihood, regression: bool, steps: int) -> float:
    """The floor's step plus the kernels that any evaluation of the value and its first derivatives runs on the
    curvature's own stored numbers, outside autograd: the shifted eigenvalues ``t = s u + δ_g(p)``, their
    reciprocals and logarithms and the sums (per group with several δ). What is above this in a step is
    bookkeeping: the graph, the checks, the likelihood's constraint."""
    u, groups, _ = curvature.diagonal_spectrum()
    num_groups = curvature.theta_sq_norms.shape[0]
    log_delta, log_s, opt = _adam(num_groups, regression)

    def step():
        opt.zero_grad()
        with torch.no_grad():
            delta = log_delta.exp()
            terms = torch.add(delta if num_groups == 1 else delta.index_select(0, groups), u,
                              alpha=float(log_s.exp()) if regression else 1.0)
            reciprocal = terms.reciprocal()
            sums = (reciprocal.sum() if num_groups == 1 else
                    reciprocal.new_zeros(num_groups).index_add_(0, groups, reciprocal))
            float(sums.sum() + terms.log_().sum() + (torch.dot(u, reciprocal) if regression else 0.0))
        (log_delta.exp().sum() + log_s.sum() if regression else log_delta.exp().sum()).backward()
        opt.step()

    return per_step(step, steps)


def _spd(size: int, seed: int = 0) -> torch.Tensor:
    a = torch.randn(size, size // 2 + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return a @ a.T / size


def bare_full_step(size: int, num_groups: int, one_delta: bool, function_space: bool, regression: bool,
                   steps: int, floor: float) -> float:
    if one_delta:
        lam = _spd(size).diagonal().clone()
        log_delta, log_s, opt = _adam(1, regression)

        def step():
            opt.zero_grad()
            rho = (log_s.exp() if regression else 1.0) / log_delta.exp()
            (-(torch.log1p(lam * rho).sum() + log_delta.sum() + log_s.sum())).backward()
            opt.step()

        return per_step(step, steps)
    grams = torch.stack([_spd(size, g) for g in range(num_groups if function_space else 1)])
    root = torch.rand(size, dtype=torch.float64) + 0.5

    def kernels():
        matrix = torch.tensordot(torch.ones(grams.shape[0], dtype=grams.dtype), grams, dims=1)
        matrix.mul_(root[:, None]).mul_(root).diagonal().add_(1)
        factor = torch.linalg.cholesky_ex(matrix)[0]
        if grams.shape[0] > 1:  # B⁻¹ from the factor (potri), its diagonal and the Grams' inner products
            inverse = torch.cholesky_inverse(factor)
            torch.tensordot(grams, inverse, dims=([1, 2], [0, 1]))
            return inverse.diagonal()
        return torch.linalg.vector_norm(triangular_inverse(factor), dim=0).square()

    return per_step(kernels, max(1, steps)) + floor  # the row's floor, measured once by the caller


def bare_low_rank_step(sizes: list[int], regression: bool, steps: int, floor: float) -> float:
    """The several-δ weight-space step when one group holds most parameters (the Schur route of
    ``ntkgp.laplace.ggn.low_rank_groups``), bare: for ``k = P − P_b`` the ``P_b × k`` weighted product
    into a ``k × k`` matrix, its Cholesky factorization and triangular inverse, the ``P_b × k`` product of the
    gradient (and for regression the inverse's inner product), plus the floor."""
    large, k = max(sizes), sum(sizes) - max(sizes)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(large, k, dtype=torch.float64, generator=g) / large**0.5
    scale = torch.rand(large, dtype=torch.float64, generator=g)
    residual = _spd(k)

    def kernels():
        matrix = torch.mm((z * scale[:, None]).mT, z).add_(residual)
        matrix.diagonal().add_(1)
        inverse = triangular_inverse(torch.linalg.cholesky_ex(matrix)[0])
        torch.linalg.vector_norm(inverse, dim=0).square()
        q = torch.mm(z, inverse.mT).square_().sum(1)
        if regression:
            (inverse.mT @ inverse * residual).sum()
        return q

    return per_step(kernels, max(1, steps)) + floor


def block_products(examples: int, shapes: list[tuple[int, int]]):
    """The GGN of ``Linear`` layers from layer features, bare: a function that makes one product per block pair
    and chunk of 256 examples, ``(n × d_a^l d_a^m)ᵀ (n × d_out^l d_out^m)``, the diagonal blocks over the pairs
    ``i ≤ j``, ``a ≤ b`` only, on random operands drawn here, before it is timed."""
    g = torch.Generator().manual_seed(0)
    operands = []
    for l, (a1, o1) in enumerate(shapes):
        for a2, o2 in shapes[l:]:
            same = (a1, o1) == (a2, o2)
            left = a1 * (a1 + 1) // 2 if same else a1 * a2
            right = o1 * (o1 + 1) // 2 if same else o1 * o2
            n = min(256, examples)
            operands.append((torch.randn(n, left, dtype=torch.float64, generator=g),
                             torch.randn(n, right, dtype=torch.float64, generator=g)))
    sizes = [min(256, examples - start) for start in range(0, examples, 256)]

    def products() -> None:
        for n in sizes:
            for x, y in operands:
                x[:n].T @ y[:n]

    return products


def bare_full_build(rows: int, num_params: int, weight_space: bool, one_delta: bool,
                    shapes: list[tuple[int, int]] | None = None, examples: int | None = None,
                    ggn: torch.Tensor | None = None) -> float:
    """The least arithmetic that forms the GGN (or the NTK Gram) and its first factorization: the Gram of an
    ``R × P`` matrix (``rows``: the function-space side, ``N·C``, ``N·(C − 1)`` for a softmax GGN) or, where ntkgp forms a weight-space GGN from layer blocks (``shapes``: ``(d_a, d_out)``
    of its layers, ``examples`` = N), the block products of :func:`block_products`; then the eigenvalues
    (one δ) or one Cholesky factorization — of the row's own GGN ``ggn`` where given (the symmetric eigensolver's
    time depends on the spectrum: a trained network's GGN deflates, a random matrix does not)."""
    blocks = weight_space and shapes is not None
    jac = None if blocks else torch.randn(rows, num_params, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(0))
    products = block_products(examples, shapes) if blocks else None
    if blocks:  # the P × P matrix to factorize, formed before the clock starts
        h = ggn.detach().to(torch.float64).clone() if ggn is not None else None
        if h is None:
            h = torch.randn(num_params, num_params, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            h = h @ h.T / num_params
    start = time.process_time()
    if weight_space:
        if blocks:
            products()
        else:
            h = gram(jac) if ggn is None else gram(jac).copy_(ggn)  # the Gram's work, on the row's own matrix
        h.diagonal().add_(1.0)
        torch.linalg.eigvalsh(h) if one_delta else torch.linalg.cholesky_ex(h)
    else:
        k = gram(jac.T)
        k.diagonal().add_(1.0)
        torch.linalg.cholesky_ex(k)
    return time.process_time() - start


def bare_kfac_build(net: torch.nn.Module, x: torch.Tensor) -> float:
    """One output: the Kronecker factors of every ``Linear`` layer from one forward and one backward pass."""
    def build():
        inputs, pre = [], []
        h = x
        for module in net:
            if isinstance(module, torch.nn.Linear):
                inputs.append(h)
                h = torch.nn.functional.linear(h, module.weight.detach(), module.bias.detach())
                if not pre:
                    h.requires_grad_()
                pre.append(h)
            else:
                h = module(h)
        grads = torch.autograd.grad(h.sum(), pre)
        value = 0.0
        for a, g in zip(inputs, grads):
            a1 = torch.cat([a.detach(), a.new_ones(a.shape[0], 1)], 1)
            ea = torch.linalg.eigvalsh(a1.T @ a1).clamp_min(0)
            eg = torch.linalg.eigvalsh(g.T @ g).clamp_min(0)
            value = value + torch.log(torch.outer(eg, ea) + 1.0).sum()
        return value

    build()
    start = time.process_time()
    build()
    return time.process_time() - start
