"""The empirical-NTK engine: Jacobians, per-group Grams, diagonals and matrix-free products.

Everything here is a function of the network at its current weights θ*. Two strategies compute the
same per-group Grams ``K_g = J_g(X1) J_g(X2)ᵀ`` (rows in GPyTorch's interleaved order ``n·C + c``):

* ``"contraction"``: per-example Jacobians by ``torch.func.vmap(jacrev)``, in chunks of
  ``chunk_size`` examples, contracted group by group;
* ``"structured"``: for every ``nn.Linear`` layer ``z = W a + b`` the Gram factorises as
  ``(a(x)·a(x') + 1) ⊙ (γ_c(x)·γ_c'(x'))`` with ``γ_c = ∂f_c/∂z``: only the layer inputs ``a`` and the
  back-propagated output gradients ``γ`` are computed, never the Jacobian (MATH.md, "Structured form").

``"auto"`` (the default) uses the structured form for every ``nn.Linear`` layer it can verify on a
probe example and contraction for all other parameters (convolutions, normalisation layers, ...).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call, jacrev, jvp, vjp, vmap
from tqdm.auto import tqdm

from .checks import check_eval_mode, check_inputs, check_outputs
from .groups import GroupSpec, resolve_groups

STRATEGIES = ("auto", "contraction", "structured")


@dataclass
class _Plan:
    """Which parameters take the structured route (per ``nn.Linear`` module) and which are contracted."""

    structured: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> {"weight"|"bias": index}
    generic: list[int] = field(default_factory=list)


@dataclass
class _Features:
    """Layer inputs ``a`` (n, d_in) and output gradients ``Γ`` (n·C, d_out) of the structured layers."""

    inputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


class NTKEngine:
    """Computes the empirical NTK of ``net`` at its current weights, without modifying the network.

    Args:
        net: any ``nn.Module`` mapping a batch ``(N, *input_shape)`` to outputs ``(N, C)``. It must not
            contain BatchNorm or dropout in training mode. Its weights, dtype, ``requires_grad`` flags
            and mode are never changed.
        groups: prior-precision groups, see :func:`ntkgp.ntk.resolve_groups`.
        chunk_size: examples per Jacobian chunk; memory of the contraction route is
            ``O(chunk_size · C · P)``.
        strategy: ``"auto"``, ``"contraction"`` or ``"structured"`` (structured for linear layers,
            contraction for the rest; ``"auto"`` also verifies each linear layer on a probe example).
        input_shape: shape of one input as the network expects it. When given, inputs arriving as
            flat ``(N, D)`` matrices (GPyTorch's convention) are reshaped to ``(N, *input_shape)``.
        max_jacobian_bytes: the contraction route keeps the Jacobian of the second argument in memory
            when it is smaller than this, and recomputes it chunk by chunk otherwise.
        progress: show a tqdm progress bar over chunks.
    """

    def __init__(
        self,
        net: nn.Module,
        groups: GroupSpec = "layer",
        chunk_size: int = 256,
        strategy: str = "auto",
        input_shape: tuple[int, ...] | None = None,
        max_jacobian_bytes: int = 2**30,
        progress: bool = False,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
        check_eval_mode(net)
        self.net = net
        self.groups = resolve_groups(net, groups)
        self.chunk_size = int(chunk_size)
        self.strategy = strategy
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.max_jacobian_bytes = int(max_jacobian_bytes)
        self.progress = progress
        self._plan: _Plan | None = None
        self._num_outputs: int | None = None

    def __deepcopy__(self, memo: dict) -> NTKEngine:
        # A copy of a kernel or model refers to the same user network: never duplicate (or detach) it.
        new = copy.copy(self)
        memo[id(self)] = new
        return new

    # ------------------------------------------------------------------ basic properties
    @property
    def num_groups(self) -> int:
        return self.groups.num_groups

    @property
    def num_params(self) -> int:
        return self.groups.num_params

    def _param_list(self) -> list[torch.Tensor]:
        named = dict(self.net.named_parameters())
        return [named[n] for n in self.groups.names]

    @property
    def dtype(self) -> torch.dtype:
        return self._param_list()[0].dtype

    @property
    def device(self) -> torch.device:
        return self._param_list()[0].device

    def params(self) -> dict[str, torch.Tensor]:
        """The trainable parameters θ*, detached (they share storage with the network's)."""
        return {n: p.detach() for n, p in zip(self.groups.names, self._param_list())}

    def group_sq_norms(self) -> torch.Tensor:
        """``‖θ*_g‖²`` per group at the current weights, shape ``(G,)`` (the prior term is ``Σ_g δ_g ‖θ*_g‖²``)."""
        norms = torch.zeros(self.num_groups, dtype=self.dtype, device=self.device)
        for p, g in zip(self._param_list(), self.groups.group_of):
            norms[g] += p.detach().square().sum()
        return norms

    def params_version(self) -> tuple:
        """A key that changes whenever a trainable parameter is replaced or updated in place."""
        return tuple((p.data_ptr(), p._version) for p in self._param_list())

    def prepare(self, x: torch.Tensor, argument: str = "x") -> torch.Tensor:
        """Check ``x`` and bring it into the network's dtype, device and input shape (a copy if needed)."""
        check_inputs(x, argument)
        check_eval_mode(self.net)
        if x.is_floating_point():
            x = x.to(dtype=self.dtype, device=self.device)
        else:
            x = x.to(device=self.device)
        if self.input_shape is not None and tuple(x.shape[1:]) != self.input_shape:
            if x.dim() == 2 and x.shape[1] == math.prod(self.input_shape):
                x = x.reshape(x.shape[0], *self.input_shape)
            else:
                raise ValueError(
                    f"{argument} must have shape (N, {', '.join(map(str, self.input_shape))}) or "
                    f"(N, {math.prod(self.input_shape)}), got {tuple(x.shape)}"
                )
        return x

    def _forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.net, params, (x,))

    def outputs(self, x: torch.Tensor, argument: str = "x") -> torch.Tensor:
        """Network outputs ``f(x; θ*)``, shape ``(N, C)``, without gradients to the network."""
        x = self.prepare(x, argument)
        with torch.no_grad():
            f = torch.cat([self._forward(self.params(), xc) for xc in x.split(self.chunk_size)])
        check_outputs(f, x.shape[0])
        self._num_outputs = f.shape[1]
        return f

    def num_outputs(self, x: torch.Tensor | None = None) -> int:
        """C, the number of network outputs (found by one forward pass of ``x[:1]`` the first time)."""
        if self._num_outputs is None:
            if x is None:
                raise RuntimeError("the number of outputs is unknown until the engine has seen an input")
            self.outputs(x[:1])
        return self._num_outputs

    def _chunks(self, n: int, desc: str) -> Iterator[tuple[int, int]]:
        starts = range(0, n, self.chunk_size)
        for s in tqdm(starts, desc=desc, disable=not self.progress or len(starts) < 2, leave=False):
            yield s, min(s + self.chunk_size, n)

    # ------------------------------------------------------------------ contraction route
    def _jacobian_chunk(self, x: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """Per-example Jacobians of the parameters ``indices``: a list of ``(n, C, numel)`` tensors."""
        names = self.groups.names
        params = self.params()
        chosen = {names[i]: params[names[i]] for i in indices}

        def f_single(sub: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return self._forward({**params, **sub}, xi.unsqueeze(0)).squeeze(0)

        jac = vmap(jacrev(f_single), in_dims=(None, 0))(chosen, x)
        return [jac[names[i]].reshape(x.shape[0], -1, self.groups.numels[i]) for i in indices]

    def _group_columns(self, x: torch.Tensor, indices: list[int]) -> dict[int, torch.Tensor]:
        """Jacobian columns of each group for the parameters ``indices``: ``{g: (n·C, P_g)}``."""
        if not indices:
            return {}
        blocks = self._jacobian_chunk(x, indices)
        by_group: dict[int, list[torch.Tensor]] = {}
        for i, block in zip(indices, blocks):
            by_group.setdefault(self.groups.group_of[i], []).append(block.reshape(-1, block.shape[-1]))
        return {g: torch.cat(cols, dim=1) for g, cols in by_group.items()}

    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked Jacobian ``J(X)``, shape ``(N·C, P)``, rows ``n·C + c``, columns in parameter order.

        This materialises ``N·C·P`` numbers; the Gram, diagonal and product methods avoid it.
        """
        x = self.prepare(x)
        indices = list(range(len(self.groups.names)))
        rows = []
        for s, e in self._chunks(x.shape[0], "Jacobians"):
            blocks = self._jacobian_chunk(x[s:e], indices)
            rows.append(torch.cat(blocks, dim=-1).reshape(-1, self.num_params))
        return torch.cat(rows)

    # ------------------------------------------------------------------ structured route
    def _linear_candidates(self) -> dict[str, dict[str, int]]:
        index = {n: i for i, n in enumerate(self.groups.names)}
        found = {}
        for mname, module in self.net.named_modules():
            if type(module) is not nn.Linear:
                continue
            prefix = f"{mname}." if mname else ""
            kinds = {k: index[prefix + k] for k in ("weight", "bias") if prefix + k in index}
            if kinds:
                found[mname] = kinds
        return found

    def _capture(self, x: torch.Tensor, modules: list[str]) -> tuple[torch.Tensor, _Features, set[str]]:
        """One forward pass recording the inputs of ``modules`` and the gradients of f w.r.t. their outputs.

        Returns the outputs ``(n, C)``, the features, and the modules that cannot be treated in
        structured form on this input (called more than once, or with inputs that are not ``(n, d)``).
        """
        lookup = dict(self.net.named_modules())
        seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {m: [] for m in modules}

        def make_hook(name: str):
            def hook(module, args, output):
                seen[name].append((args[0], output))

            return hook

        handles = [lookup[m].register_forward_hook(make_hook(m)) for m in modules]
        try:
            params = {n: p.requires_grad_(True) for n, p in self.params().items()}
            with torch.enable_grad():
                f = self._forward(params, x)
                n = x.shape[0]
                bad = {m for m, calls in seen.items() if len(calls) != 1 or calls[0][0].dim() != 2 or calls[0][0].shape[0] != n}
                good = [m for m in modules if m not in bad]
                check_outputs(f, n)
                grads: dict[str, list[torch.Tensor]] = {m: [] for m in good}
                outs = [seen[m][0][1] for m in good]
                if good:
                    for c in range(f.shape[1]):
                        cot = torch.zeros_like(f)
                        cot[:, c] = 1.0
                        gs = torch.autograd.grad(f, outs, cot, retain_graph=c + 1 < f.shape[1], allow_unused=True)
                        for m, g, z in zip(good, gs, outs):
                            grads[m].append(torch.zeros_like(z) if g is None else g)
        finally:
            for h in handles:
                h.remove()
        features = _Features(
            inputs={m: seen[m][0][0].detach() for m in good},
            grads={m: torch.stack(grads[m], dim=1).reshape(n * f.shape[1], -1) for m in good},
        )
        return f.detach(), features, bad

    def plan(self, x: torch.Tensor) -> _Plan:
        """Decide which parameters take the structured route, verified once on the probe ``x[:1]``."""
        if self._plan is not None:
            return self._plan
        candidates = {} if self.strategy == "contraction" else self._linear_candidates()
        probe = x[:1]
        f, features, bad = self._capture(probe, list(candidates))
        self._num_outputs = f.shape[1]
        if self.strategy == "structured" and bad:
            raise ValueError(
                f"strategy='structured' cannot treat linear layers {sorted(bad)} (called more than once per "
                "forward pass or with inputs that are not (N, d)); use strategy='auto'"
            )
        structured = {m: kinds for m, kinds in candidates.items() if m not in bad}
        if self.strategy == "auto" and structured:
            structured = self._verified(probe, structured, features)
        in_structured = {i for kinds in structured.values() for i in kinds.values()}
        generic = [i for i in range(len(self.groups.names)) if i not in in_structured]
        self._plan = _Plan(structured=structured, generic=generic)
        return self._plan

    def _verified(self, probe: torch.Tensor, structured: dict[str, dict[str, int]], features: _Features):
        """Keep the linear layers whose structured Jacobian equals autograd's on the probe example.

        Guards against weights shared with other modules or used outside the layer's forward.
        """
        indices = [i for kinds in structured.values() for i in kinds.values()]
        exact = dict(zip(indices, self._jacobian_chunk(probe, indices)))
        keep = {}
        for m, kinds in structured.items():
            a, gam = features.inputs[m][0], features.grads[m]  # (d_in,), (C, d_out)
            ok = True
            for kind, i in kinds.items():
                approx = (gam[:, :, None] * a[None, None, :]).reshape(gam.shape[0], -1) if kind == "weight" else gam
                ref = exact[i][0]
                tol = 1e-4 if ref.dtype == torch.float32 else 1e-9
                ok &= torch.allclose(approx, ref, rtol=tol, atol=tol * (1 + ref.abs().max().item()))
            if ok:
                keep[m] = kinds
        return keep

    def _features(self, x: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, _Features]:
        """Layer features over all of ``x``, chunk by chunk (memory ``O(N·C·Σ d_out)``)."""
        fs, inputs, grads = [], {}, {}
        modules = list(plan.structured)
        for s, e in self._chunks(x.shape[0], "layer features"):
            f, feats, _ = self._capture(x[s:e], modules)
            fs.append(f)
            for m in modules:
                inputs.setdefault(m, []).append(feats.inputs[m])
                grads.setdefault(m, []).append(feats.grads[m])
        return torch.cat(fs), _Features(
            inputs={m: torch.cat(v) for m, v in inputs.items()}, grads={m: torch.cat(v) for m, v in grads.items()}
        )

    # ------------------------------------------------------------------ Grams
    def group_grams(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        """Per-group Grams ``K_g = J_g(X1) J_g(X2)ᵀ``, shape ``(G, N1·C, N2·C)``, interleaved order.

        With ``x2=None`` the symmetric Gram of ``x1`` is computed (only its lower blocks are contracted).
        """
        x1 = self.prepare(x1, "x1")
        sym = x2 is None
        x2 = x1 if sym else self.prepare(x2, "x2")
        plan = self.plan(x1)
        c = self.num_outputs(x1)
        n1, n2 = x1.shape[0], x2.shape[0]
        out = torch.empty(self.num_groups, n1 * c, n2 * c, dtype=self.dtype, device=self.device)
        written = self._structured_grams(out, x1, x2, sym, plan, c) if plan.structured else set()
        for g in range(self.num_groups):
            if g not in written:
                out[g].zero_()
        if plan.generic:
            self._contracted_grams(out, x1, x2, sym, plan.generic, c)
        return out

    def _structured_grams(self, out, x1, x2, sym, plan, c) -> set[int]:
        """Add the structured terms to ``out``; returns the groups written (the others are left untouched).

        A group met for the first time is written in place (``mm`` into ``out[g]``, then ``mul_``), so a
        layer costs one GEMM and one pass over its ``(N1·C, N2·C)`` block.
        """
        _, f1 = self._features(x1, plan)
        f2 = f1 if sym else self._features(x2, plan)[1]
        n1, n2 = x1.shape[0], x2.shape[0]
        written: set[int] = set()
        for m, kinds in plan.structured.items():
            g1, g2 = f1.grads[m], f2.grads[m]
            aa = f1.inputs[m] @ f2.inputs[m].T if "weight" in kinds else None
            terms = []  # (group, factor on the input kernel or None)
            if "weight" in kinds and "bias" in kinds and self.groups.group_of[kinds["weight"]] == self.groups.group_of[kinds["bias"]]:
                terms.append((self.groups.group_of[kinds["weight"]], aa + 1))
            else:
                terms += [(self.groups.group_of[i], aa if k == "weight" else None) for k, i in kinds.items()]
            for g, factor in terms:
                if g in written:  # accumulate over row slices: temporaries stay small
                    rows = max(1, (1 << 24) // max(1, n2 * c * c))
                    for s in range(0, n1, rows):
                        e = min(s + rows, n1)
                        block = (g1[s * c : e * c] @ g2.T).view(e - s, c, n2, c)
                        if factor is not None:
                            block.mul_(factor[s:e, None, :, None])
                        out[g, s * c : e * c].add_(block.view((e - s) * c, n2 * c))
                else:
                    torch.mm(g1, g2.T, out=out[g])
                    if factor is not None:
                        out[g].view(n1, c, n2, c).mul_(factor[:, None, :, None])
                    written.add(g)
        return written

    def _contracted_grams(self, out, x1, x2, sym, indices, c) -> None:
        n2 = x2.shape[0]
        width = sum(self.groups.numels[i] for i in indices)
        keep = n2 * c * width * x2.element_size() <= self.max_jacobian_bytes
        chunks2 = [(s, min(s + self.chunk_size, n2)) for s in range(0, n2, self.chunk_size)]
        stored = [self._group_columns(x2[s:e], indices) for s, e in chunks2] if keep and not sym else None
        stored_sym: list[dict[int, torch.Tensor]] = []
        for s1, e1 in self._chunks(x1.shape[0], "Gram"):
            j1 = self._group_columns(x1[s1:e1], indices)
            if sym:
                if keep:
                    stored_sym.append(j1)
                pairs = [(k, *chunks2[k]) for k in range(len(chunks2)) if chunks2[k][0] <= s1]
            else:
                pairs = [(k, *chunks2[k]) for k in range(len(chunks2))]
            for k, s2, e2 in pairs:
                if sym and s2 == s1:
                    j2 = j1
                elif sym:
                    j2 = stored_sym[k] if keep else self._group_columns(x1[s2:e2], indices)
                else:
                    j2 = stored[k] if keep else self._group_columns(x2[s2:e2], indices)
                for g, a in j1.items():
                    block = a @ j2[g].T
                    out[g, s1 * c : e1 * c, s2 * c : e2 * c] += block
                    if sym and s2 != s1:
                        out[g, s2 * c : e2 * c, s1 * c : e1 * c] += block.T

    def output_grams(
        self, x1: torch.Tensor, x2: torch.Tensor | None = None, with_diagonal: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-group, per-output Grams ``[K_g]_{(n,c),(m,c)}``, shape ``(G, C, N1, N2)``: the diagonal output
        blocks of :meth:`group_grams` (what a model with independent outputs uses).

        When every trainable parameter takes the structured route they come from the layer features,
        per ``nn.Linear`` layer ``(a(x)·a(x') + 1)(γ_c(x)·γ_c(x'))``: ``C`` times fewer flops and memory than
        the full Gram. Otherwise they are read off :meth:`group_grams`. With ``x2=None``, ``x2 = x1``.

        With ``with_diagonal=True`` also returns the output diagonals of the per-point blocks of ``x2``,
        ``[J_g(x2_m) J_g(x2_m)ᵀ]_{cc}``, shape ``(G, N2, C)`` (from the same features in structured form,
        else from :meth:`diag_blocks`).
        """
        x1 = self.prepare(x1, "x1")
        sym = x2 is None
        x2 = x1 if sym else self.prepare(x2, "x2")
        plan = self.plan(x1)
        c = self.num_outputs(x1)
        n1, n2 = x1.shape[0], x2.shape[0]
        if plan.generic or not plan.structured:
            full = self.group_grams(x1, None if sym else x2)
            grams = full.view(self.num_groups, n1, c, n2, c).diagonal(dim1=2, dim2=4).permute(0, 3, 1, 2)
            grams = grams.contiguous()
            if not with_diagonal:
                return grams
            return grams, self.diag_blocks(x2).diagonal(dim1=-2, dim2=-1).contiguous()
        _, f1 = self._features(x1, plan)
        f2 = f1 if sym else self._features(x2, plan)[1]
        kw = {"dtype": self.dtype, "device": self.device}
        out = torch.zeros(self.num_groups, c, n1, n2, **kw)
        diag = torch.zeros(self.num_groups, n2, c, **kw) if with_diagonal else None
        group_of = self.groups.group_of
        for m, kinds in plan.structured.items():
            gam1 = f1.grads[m].view(n1, c, -1).transpose(0, 1)
            gam2 = f2.grads[m].view(n2, c, -1).transpose(0, 1)
            per_output = torch.bmm(gam1, gam2.transpose(1, 2))  # (C, N1, N2)
            weight = "weight" in kinds
            aa = f1.inputs[m] @ f2.inputs[m].T if weight else None
            a2 = f2.inputs[m].square().sum(-1)[:, None] if weight and with_diagonal else None
            g2 = gam2.square().sum(-1).T if with_diagonal else None  # (N2, C)
            if weight and "bias" in kinds and group_of[kinds["weight"]] == group_of[kinds["bias"]]:
                terms = [(group_of[kinds["weight"]], aa + 1, None if a2 is None else a2 + 1)]
            else:
                terms = [(group_of[i], aa if k == "weight" else None, a2 if k == "weight" else None) for k, i in kinds.items()]
            for g, factor, factor_diag in terms:
                out[g] += per_output if factor is None else per_output * factor
                if with_diagonal:
                    diag[g] += g2 if factor_diag is None else g2 * factor_diag
        return (out, diag) if with_diagonal else out

    def diag_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group, per-point ``C×C`` blocks ``J_g(x_n) J_g(x_n)ᵀ``, shape ``(G, N, C, C)``, without the Gram."""
        x = self.prepare(x)
        plan = self.plan(x)
        c = self.num_outputs(x)
        n = x.shape[0]
        out = torch.zeros(self.num_groups, n, c, c, dtype=self.dtype, device=self.device)
        if plan.structured:
            _, feats = self._features(x, plan)
            for m, kinds in plan.structured.items():
                gam = feats.grads[m].view(n, c, -1)
                gg = gam @ gam.transpose(-1, -2)
                if "weight" in kinds:
                    aa = (feats.inputs[m] ** 2).sum(-1)
                    out[self.groups.group_of[kinds["weight"]]] += aa[:, None, None] * gg
                if "bias" in kinds:
                    out[self.groups.group_of[kinds["bias"]]] += gg
        if plan.generic:
            for s, e in self._chunks(n, "diagonal"):
                for g, cols in self._group_columns(x[s:e], plan.generic).items():
                    jn = cols.view(e - s, c, -1)
                    out[g, s:e] += jn @ jn.transpose(-1, -2)
        return out

    # ------------------------------------------------------------------ matrix-free products
    def vjp(self, x: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """``J(X)ᵀ v`` for ``v`` of shape ``(N·C,)`` or ``(N·C, k)``: per parameter, shape ``(*p.shape[, k])``."""
        x = self.prepare(x)
        c = self.num_outputs(x)
        n = x.shape[0]
        batched = v.dim() == 2
        vv = v.reshape(n, c, -1).to(self.dtype)
        params = self.params()
        total = {name: torch.zeros(*p.shape, vv.shape[-1], dtype=p.dtype, device=p.device) for name, p in params.items()}
        for s, e in self._chunks(n, "J^T v"):
            _, pull = vjp(lambda p, xs=x[s:e]: self._forward(p, xs), params)
            grads = vmap(pull, in_dims=-1, out_dims=-1)(vv[s:e])[0]
            for name in total:
                total[name] += grads[name]
        return total if batched else {k: t.squeeze(-1) for k, t in total.items()}

    def jvp(self, x: torch.Tensor, u: dict[str, torch.Tensor]) -> torch.Tensor:
        """``J(X) u`` for parameter-shaped tangents ``u`` (optionally with a trailing ``k``): ``(N·C[, k])``."""
        x = self.prepare(x)
        params = self.params()
        shapes = {name: p.shape for name, p in params.items()}
        batched = any(u[name].dim() == len(shapes[name]) + 1 for name in u)
        uu = {name: (t if batched else t.unsqueeze(-1)).to(self.dtype) for name, t in u.items()}
        rows = []
        for s, e in self._chunks(x.shape[0], "J u"):

            def push(t, xs=x[s:e]):
                return jvp(lambda p: self._forward(p, xs), (params,), (t,))[1]

            rows.append(vmap(push, in_dims=-1, out_dims=-1)(uu))
        out = torch.cat(rows).reshape(-1, rows[0].shape[-1])
        return out if batched else out.squeeze(-1)

    def matvec(self, x: torch.Tensor, v: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Matrix-free ``K v = Σ_g w_g J_g (J_gᵀ v)`` (one vector-Jacobian and one Jacobian-vector product).

        Args:
            x: inputs ``(N, ...)``.
            v: ``(N·C,)`` or ``(N·C, k)`` in interleaved order.
            weights: ``(G,)`` group weights, e.g. ``1/δ``.
        """
        jtv = self.vjp(x, v)
        scaled = {}
        for name, g in zip(self.groups.names, self.groups.group_of):
            t = jtv[name]
            scaled[name] = t * weights[g].to(t)
        return self.jvp(x, scaled)
