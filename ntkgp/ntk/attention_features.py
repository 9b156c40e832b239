r"""The projections of ``nn.MultiheadAttention`` as shared linear layers: their inputs and output gradients recorded
during the feature pass, so that the NTK, KFAC and the other structured passes treat them as ``nn.Linear`` layers
on sequences.

``nn.MultiheadAttention`` applies its packed in-projection :math:`[W_q; W_k; W_v]` (``in_proj_weight`` ``(3E, E)``,
``in_proj_bias``) and its output projection (``out_proj``) inside ``F.multi_head_attention_forward``, never by
calling a module: no forward hook sees them. During a feature pass the module's forward runs under a
``TorchFunctionMode`` (on ntkgp's private copy of the network, for the length of the call) that replaces that
function by :func:`attention_forward`, the same computation with the two projections as explicit ``F.linear``
calls whose inputs and outputs are recorded. Each projection is then a linear layer :math:`z_t = W a_t + b` shared
over its locations :math:`t`, and

.. math::
    \frac{\partial f_c}{\partial W} = \sum_t \Gamma_{ct}\, a_t^\top, \qquad
    \frac{\partial f_c}{\partial b} = \sum_t \Gamma_{ct}, \qquad
    [J_W(x) J_W(x')^\top]_{cc'} = \sum_{t, t'} \langle a_t, a'_{t'} \rangle \langle \Gamma_{ct}, \Gamma'_{c't'} \rangle

(``docs/math.md``, "Structured form"): exact, with the :math:`T` positions as the locations of a linear layer on
sequences.

* **in-projection** (layer named as the attention module, parameters ``in_proj_weight`` / ``in_proj_bias``): the
  distinct tensors among query, key and value stacked along the sequence, :math:`a = [x_q; x_k; x_v]`
  (self-attention: one tensor, :math:`T = L`), and :math:`z = W a + b` ``(T, N, 3E)``; the query rows of :math:`z` are
  taken from the query's positions, the key and value rows from the key's and value's. The gradient at the
  positions of another role is zero, so :math:`\sum_t \Gamma_t a_t^\top` is the exact Jacobian; with cross-attention
  the projection is computed at every stacked position (at most 3× the in-projection's multiply-adds, in the feature
  pass only). Separate ``q/k/v_proj_weight`` (``kdim``/``vdim`` other than ``embed_dim``) take the generic route.
* **out-projection** (layer ``<attention>.out_proj``): its input is the heads' concatenated output
  :math:`(L, N, E)`, :math:`T = L`.

KFAC treats both as any linear layer on sequences (:mod:`ntkgp.laplace.weight_space.kfac.curvature`): "expand" sums
:math:`\bar a_t \bar a_t^\top` and :math:`\Gamma_t \Gamma_t^\top` over the :math:`T` locations, "reduce" sums the
locations first (for cross-attention the in-projection's stacked query, key and value positions together).

Other configurations (``bias_k``/``bias_v``, ``add_zero_attn``, ``static_k``/``static_v``, unbatched inputs) run
torch's own function unrecorded: their projections take the generic per-example route (the layer plan's check
finds them never called). The verification of the layer plan (the structured Jacobian equals autograd's on a probe
example, :func:`~ntkgp.ntk.layer_plan.verify_layers`) covers :func:`attention_forward` as well: it is compared with
torch's own forward.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .features import Layer
from .function_taps import attach_mode

__all__ = ["AttentionProjection", "attention_candidates", "attention_forward", "rebuild_layer"]

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
#: Recorder: ``callback(module, (input,), output)``, a forward hook's signature.
Recorder = Callable[[object, tuple, Tensor], None]


def _supported(module: nn.MultiheadAttention) -> bool:
    """Whether :func:`attention_forward` computes the module's attention (module docstring)."""
    return module.bias_k is None and module.bias_v is None and not module.add_zero_attn


def attention_forward(arguments: dict, record_in: Recorder | None, record_out: Recorder | None):
    r"""``F.multi_head_attention_forward`` (its arguments by name) with explicit, recorded projections, or ``None``
    where the configuration is not covered (module docstring). Inputs are sequence-first ``(L, N, E)``; the recorders
    get the in-projection's stacked input ``(T, N, E)`` and output ``(T, N, 3E)``, and the out-projection's input and
    output ``(L, N, E)``."""
    a = arguments
    query, key, value = a["query"], a["key"], a["value"]
    if (a["bias_k"] is not None or a["bias_v"] is not None or a["add_zero_attn"] or a["static_k"] is not None
            or a["static_v"] is not None or query.dim() != 3 or (a["is_causal"] and a["attn_mask"] is None)):
        return None
    length, batch, embed = query.shape
    source, heads = key.shape[0], a["num_heads"]
    head_dim = embed // heads
    key_padding_mask = F._canonical_mask(mask=a["key_padding_mask"], mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(a["attn_mask"]), other_name="attn_mask",
                                         target_type=query.dtype)
    attn_mask, is_causal, need_weights = a["attn_mask"], a["is_causal"], a["need_weights"]
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    if a["use_separate_proj_weight"]:
        b_q = b_k = b_v = None
        if a["in_proj_bias"] is not None:
            b_q, b_k, b_v = a["in_proj_bias"].chunk(3)
        q = F.linear(query, a["q_proj_weight"], b_q)
        k = F.linear(key, a["k_proj_weight"], b_k)
        v = F.linear(value, a["v_proj_weight"], b_v)
    else:
        parts: list[Tensor] = []
        starts: list[int] = []

        def place(t: Tensor) -> int:
            for part, start in zip(parts, starts):
                if part is t:
                    return start
            starts.append(sum(p.shape[0] for p in parts))
            parts.append(t)
            return starts[-1]

        sq, sk, sv = place(query), place(key), place(value)
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        z = F.linear(stacked, a["in_proj_weight"], a["in_proj_bias"])
        if record_in is not None:
            record_in(None, (stacked,), z)
        q = z[sq : sq + length, :, :embed]
        k = z[sk : sk + source, :, embed : 2 * embed]
        v = z[sv : sv + source, :, 2 * embed :]
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q = q.reshape(length, batch * heads, head_dim).transpose(0, 1)
    k = k.reshape(source, batch * heads, head_dim).transpose(0, 1)
    v = v.reshape(source, batch * heads, head_dim).transpose(0, 1)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(batch, 1, 1, source).expand(-1, heads, -1, -1).reshape(batch * heads, 1, source)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    weights = None
    if need_weights:
        scaled = q * math.sqrt(1.0 / float(head_dim))
        scores = (torch.baddbmm(attn_mask, scaled, k.transpose(-2, -1)) if attn_mask is not None
                  else torch.bmm(scaled, k.transpose(-2, -1)))
        scores = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            scores = F.dropout(scores, p=dropout_p)
        heads_out = torch.bmm(scores, v).transpose(0, 1).reshape(length, batch, embed)
        weights = scores.view(batch, heads, length, source)
        if a["average_attn_weights"]:
            weights = weights.mean(dim=1)
    else:
        if attn_mask is not None:
            attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 and attn_mask.dim() == 3
                         else attn_mask.view(batch, heads, -1, source))
        out = F.scaled_dot_product_attention(q.view(batch, heads, length, head_dim), k.view(batch, heads, source, head_dim),
                                             v.view(batch, heads, source, head_dim), attn_mask, dropout_p, is_causal)
        heads_out = out.permute(2, 0, 1, 3).reshape(length, batch, embed)
    output = F.linear(heads_out, a["out_proj_weight"], a["out_proj_bias"])
    if record_out is not None:
        record_out(None, (heads_out,), output)
    return output, weights


class _Tap(TorchFunctionMode):
    """Replaces ``F.multi_head_attention_forward`` by :func:`attention_forward` with the recorders of one module."""

    def __init__(self, recorders: dict[str, list[Recorder]]) -> None:
        super().__init__()
        self.recorders = recorders

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            bound = _SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()

            def each(kind: str) -> Recorder | None:
                hooks = self.recorders[kind]
                return (lambda m, i, o: [h(m, i, o) for h in hooks]) if hooks else None

            out = attention_forward(bound.arguments, each("in"), each("out"))
            if out is not None:
                return out
        return func(*args, **kwargs)


class _TapHandle:
    """Removes one recorder; the last one removed detaches the module's :class:`_Tap`."""

    def __init__(self, module: nn.Module, kind: str, recorder: Recorder) -> None:
        self.module, self.kind, self.recorder = module, kind, recorder

    def remove(self) -> None:
        taps = self.module.__dict__.get(_KEY)
        if taps is None:
            return
        hooks = taps[self.kind]
        if self.recorder in hooks:
            hooks.remove(self.recorder)
        if not taps["in"] and not taps["out"]:
            del self.module.__dict__[_KEY]
            taps["handle"].remove()


_KEY = "_ntkgp_attention_taps"


def attach_tap(module: nn.MultiheadAttention, kind: str, recorder: Recorder) -> _TapHandle:
    """Record the ``kind`` (``"in"`` or ``"out"``) projection of ``module`` (ntkgp's private copy) with ``recorder``
    until the handle is removed: the module's forward runs under one :class:`_Tap`
    (:func:`~ntkgp.ntk.function_taps.attach_mode`)."""
    taps = module.__dict__.get(_KEY)
    if taps is None:
        taps = {"in": [], "out": []}
        taps["handle"] = attach_mode(module, _Tap(taps))
        module.__dict__[_KEY] = taps
    taps[kind].append(recorder)
    return _TapHandle(module, kind, recorder)


@dataclass(frozen=True)
class AttentionProjection(Layer):
    r"""A projection of an ``nn.MultiheadAttention`` as a linear layer on sequence-first tensors ``(T, N, d)``
    (module docstring): ``kind`` ``"in"`` (the layer is named as the attention module; ``module`` is it) or ``"out"``
    (named ``<attention>.out_proj``; ``module`` is the ``out_proj`` linear layer)."""

    kind: str = "in"
    attention: str = ""

    def _parameter(self, which: str) -> Tensor:
        if self.kind == "in":
            return getattr(self.module, f"in_proj_{which}")
        return getattr(self.module, which)

    def requires_grad(self) -> bool:
        return any(self._parameter(k).requires_grad for k, n in (("weight", self.weight), ("bias", self.bias))
                   if n is not None)

    @property
    def fan_in(self) -> int:
        return self._parameter("weight").shape[1] if self.weight is not None else 0

    @property
    def d_out(self) -> int:
        return self._parameter("weight" if self.weight is not None else "bias").shape[0]

    def attach(self, net: nn.Module, recorder: Recorder):
        return attach_tap(net.get_submodule(self.attention), self.kind, recorder)

    def takes(self, inputs: object, n: int) -> bool:
        return torch.is_tensor(inputs) and inputs.dim() == 3 and inputs.shape[1] == n

    def recorded_inputs(self, inputs: Tensor) -> Tensor:
        """``(T, N, d_in)`` → ``(N, d_in, T)``."""
        return inputs.permute(1, 2, 0)

    def recorded_gradients(self, grads: Tensor) -> Tensor:
        """``(T, N, d_out)`` → ``(N, d_out, T)``."""
        return grads.permute(1, 2, 0)


def attention_candidates(name: str, module: nn.Module, chosen: set[str], shared: Callable[[Tensor], bool]
                         ) -> list[AttentionProjection]:
    """The projections of the attention module ``name`` whose parameters are in ``chosen`` and owned by no other
    module (``shared(p)``), for a configuration :func:`attention_forward` covers; ``[]`` for any other module."""
    if type(module) is not nn.MultiheadAttention or not _supported(module):
        return []
    prefix = f"{name}." if name else ""
    out = []

    def pick(owner: nn.Module, keys: tuple[str, str], names: tuple[str, str]):
        found = [n if n in chosen else None for n in names]
        tensors = [getattr(owner, k) for k in keys]
        if all(f is None for f in found) or any(t is not None and shared(t) for t in tensors):
            return None
        return found

    if module._qkv_same_embed_dim:
        found = pick(module, ("in_proj_weight", "in_proj_bias"), (prefix + "in_proj_weight", prefix + "in_proj_bias"))
        if found is not None:
            out.append(AttentionProjection(name, module, found[0], found[1], "in", name))
    found = pick(module.out_proj, ("weight", "bias"), (prefix + "out_proj.weight", prefix + "out_proj.bias"))
    if found is not None:
        out.append(AttentionProjection(prefix + "out_proj", module.out_proj, found[0], found[1], "out", name))
    return out


def rebuild_layer(net: nn.Module, name: str, weight: str | None, bias: str | None) -> Layer:
    """The layer ``name`` of ``net`` with the parameters ``weight`` and ``bias``, as the layer plan builds it: an
    :class:`AttentionProjection` for an attention module's projections, else a :class:`~ntkgp.ntk.features.Layer`
    (e.g. to rebuild a KFAC block's layer from its names)."""
    modules = dict(net.named_modules())
    module = modules[name]
    if type(module) is nn.MultiheadAttention:
        return AttentionProjection(name, module, weight, bias, "in", name)
    parent, _, last = name.rpartition(".")
    if last == "out_proj" and type(modules.get(parent)) is nn.MultiheadAttention:
        return AttentionProjection(name, module, weight, bias, "out", parent)
    return Layer(name, module, weight, bias)
