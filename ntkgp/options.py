"""Every option string of ntkgp in one place, as ``str`` enums, and the one mechanism for option attributes.

Each public argument that takes one of a fixed set of strings is validated here with :func:`choose`, so
that the accepted values and the error message are the same everywhere. The enum
members compare equal to their strings (``Space.WEIGHT == "weight"``), so users pass plain strings.
"""

from __future__ import annotations

import warnings
from enum import Enum
from typing import TypeVar


class Option(str, Enum):
    """Base class: a string option whose value is its string."""

    def __str__(self) -> str:
        return self.value


class PriorStructure(Option):
    """How prior precisions :math:`\\delta` are shared between parameters (``prior_structure=``)."""

    NETWORK = "network"  #: one δ for the whole network (laplace-torch's "scalar")
    LAYER = "layer"  #: one δ per module that owns parameters (laplace-torch's "layerwise")
    PARAMETER = "parameter"  #: one δ per parameter tensor (weight and bias separately)


class Strategy(Option):
    """How the NTK engine computes Grams (``strategy=``)."""

    AUTO = "auto"
    CONTRACTION = "contraction"
    STRUCTURED = "structured"


class Space(Option):
    """Where an NTK computation is carried out (``space=``): on the ``N·C`` function values or the ``P`` weights.

    ``"function"``: dense ``(N·C)²`` Grams; ``"weight"``: the Jacobian ``J`` as a low-rank root (kernel) or a
    ``P × P`` system (evidence). ``"auto"`` picks weight space when ``N·C > 0.85 P`` (:func:`choose_space`, measured).
    """

    AUTO = "auto"
    FUNCTION = "function"
    WEIGHT = "weight"


class Structure(Option):
    """The curvature used for the Laplace evidence and posterior (``structure=``)."""

    FULL_GGN = "full_ggn"
    FULL_EF = "full_ef"
    KFAC = "kfac"
    DIAG_GGN = "diag_ggn"
    DIAG_EF = "diag_ef"


class CurvatureKind(Option):
    """Which curvature a Laplace approximation takes (``curvature=``): the generalised Gauss–Newton or the
    empirical Fisher, laplace-torch's ``GGN`` and ``EF`` backends. (The structured curvature objects themselves are
    :class:`ntkgp.laplace.weight_space.Curvature`.)"""

    GGN = "ggn"
    EF = "ef"


class OutputCoupling(Option):
    """How SFR couples the ``C`` outputs (``output_coupling=``)."""

    JOINT = "joint"  #: one (M·C)² system with the full C×C likelihood Hessian
    INDEPENDENT = "independent"  #: C systems of size M² (diagonal of the Hessian)


class StatisticsMode(Option):
    """How SFR keeps its dual statistics across the prior groups (``statistics=``)."""

    PER_GROUP = "per_group"  #: per pair of groups: δ may change (and be learned) without the data; G² × the memory
    COMBINED = "combined"  #: for the combined kernel at the δ of the pass over the data: one group; δ fixed


class PriorMean(Option):
    """The GP prior mean of SFR (``prior_mean=``)."""

    ZERO = "zero"
    LINEARIZED = "linearized"  #: m(x) = f(x; θ*) − J(x) θ*


class PredictiveMean(Option):
    """What a predictive's mean is (``predictive_mean=``)."""

    GP = "gp"  #: the posterior mean of the linearized model
    NN = "nn"  #: the network output f(x; θ*)


class InducingMethod(Option):
    """How SFR chooses inducing inputs (``inducing=``)."""

    RANDOM = "random"
    GREEDY_VARIANCE = "greedy_variance"


class EvidenceMethod(Option):
    """How the log-determinant of the Laplace evidence is computed (``method=``)."""

    AUTO = "auto"
    CHOLESKY = "cholesky"  #: dense Cholesky in function or weight space (exact)
    EIGEN = "eigen"  #: one eigendecomposition, then O(N·k) per step (one δ, fixed sites; exact)
    MATRIX_FREE = "matrix_free"  #: CG + stochastic Lanczos quadrature on a matrix-free operator (estimate)


class Subset(Option):
    """Which weights a posterior is over (``subset=``)."""

    ALL = "all"
    LAST_LAYER = "last_layer"  #: one layer (default the last); full, KFAC or diagonal, from its features
    SUBNETWORK = "subnetwork"  #: chosen parameters or coordinates, by name or by boolean mask; full


class Method(Option):
    """How the GLM predictive is estimated (``method=``)."""

    GLM = "glm"  #: closed form J Σ Jᵀ
    GLM_MC = "glm_mc"  #: samples f + J η by exact Jacobian-vector products
    MC_GLM = "mc_glm"  #: samples f + A η with finite-difference directional derivatives
    NN_SAMPLING = "nn_sampling"  #: samples f(x; θ* + η) through the network


class Link(Option):
    """How class probabilities are approximated (``link=``)."""

    PROBIT = "probit"
    BRIDGE = "bridge"
    MC = "mc"


class FiniteDifference(Option):
    """The finite-difference scheme of ``method="mc_glm"`` (``finite_difference=``)."""

    CENTRAL = "central"
    FORWARD = "forward"


E = TypeVar("E", bound=Option)


def choose(enum: type[E], value: object, argument: str) -> E:
    """Validate ``value`` as a member of ``enum`` (a string or a member).

    Raises:
        ValueError: naming ``argument`` and the accepted values.
    """
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            pass
    accepted = ", ".join(repr(m.value) for m in enum)
    raise ValueError(f"{argument} must be one of {accepted}, got {value!r}")


#: ``"auto"`` takes weight space once the function-space side ``R`` exceeds this fraction of ``P``. Measured by
#: ``benchmarks/evidence_routes.py --crossover`` (docs/ntkgp.md) and on a finer grid beside it: an exact evidence
#: step (per-tensor δ, the curvature built once, softmax with 3 classes, P = 1179) costs the same in both spaces at
#: ``N·C ≈ 0.9 P`` with one thread (two runs on 2026-12-03 at N·C/P = 0.7, 0.8, 0.85, 0.9, 1.0: function space
#: 22.7, 31.4, 36.4-38.2, 42.8, 56-58 ms; weight space, a Cholesky factorization and a triangular inverse, 41-43
#: ms throughout) and at ``≈ 0.82 P`` in CPU time with two threads; the rule lies between them. The function-space
#: step is cheaper than in the previous measurement (``≈ 0.7 P``) since its gradient takes ``B⁻¹`` from the factor
#: (``cholesky_inverse``, ``2R³/3`` flops) instead of ``L⁻¹`` and ``L⁻ᵀ L⁻¹`` (``7R³/3``). The rule counts steps
#: with the curvature built once: where it is rebuilt for every step (``train_marglik`` with ``hyper_steps=1``) the
#: builds dominate, ``(N C)² P`` against ``N C P²`` operations, and by these counts function space is the cheaper
#: one up to ``N·C ≈ P``.
#: Measured again on 2026-12-05 after the softmax GGN's function-space side shrank to ``R = N·(C − 1)`` rows (the
#: root of ``Λ_n`` with ``C − 1`` columns): at N·C/P = 0.5, 0.75, 1.0, 1.5, 2.0 (R/P = 0.33, 0.5, 0.67, 1.0,
#: 1.33) function space 4.7, 9.7, 18.0, 47.9, 93.2 ms against weight space 35-38 ms (and in the table's run,
#: 12:10 UTC: 4.8, 9.7, 18.1, 51.2, 104 against 37-41 ms), equal at ``R ≈ 0.9 P`` as before: the rule holds for
#: the function-space side ``R`` (``num_rows``), which for a softmax GGN is ``N·(C − 1)``.
WEIGHT_SPACE_FROM = 0.85


def choose_space(space: Space | str, num_params: int, num_rows: int) -> Space:
    """Resolve ``"auto"``: weight space when the function-space side ``R`` (``num_rows``: ``N·C``, ``N·(C − 1)``
    for a softmax GGN, ``N`` for the EF) exceeds ``WEIGHT_SPACE_FROM · P`` (the cheaper exact route, measured),
    else function space."""
    space = choose(Space, space, "space")
    if space is not Space.AUTO:
        return space
    return Space.WEIGHT if num_rows > WEIGHT_SPACE_FROM * num_params else Space.FUNCTION




class OptionAttribute:
    """A public attribute that a constructor argument sets, validated on every assignment (one mechanism for all).

    Declared on the class (``predictive_mean = OptionAttribute(choice(PredictiveMean), on_change="_refresh")``) and
    assigned once in ``__init__``. A later assignment is validated by the constructor's own validator (strings
    and enum members alike), then either

    * ``on_change`` names a method of the owner, called with the attribute's name after the new value is stored
      and only when it differs from the old one: the owner recomputes (or drops) what depends on it, so that
      the object equals one built with the new value; or
    * ``fixed`` gives the reason the value cannot change after construction: assigning another value raises
      ``AttributeError`` saying to build a new object (assigning the same value is a no-op).

    Exactly one of the two is given. Owners list their option attributes with :func:`option_attributes`.
    """

    def __init__(self, validate, *, on_change: str | None = None, fixed: str | None = None):
        if (on_change is None) == (fixed is None):
            raise TypeError("OptionAttribute takes exactly one of on_change= and fixed=")
        self.validate = validate
        self.on_change = on_change
        self.fixed = fixed
        self.name = ""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        self._slot = f"_option_{name}"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self._slot]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is not set yet") from None

    def __set__(self, obj, value) -> None:
        new = self.validate(value, self.name)
        state = obj.__dict__
        if self._slot not in state:  # the constructor's assignment
            state[self._slot] = new
            return
        old = state[self._slot]
        if _same_option(old, new):
            return
        self.refuse_if_fixed(obj, value)
        state[self._slot] = new
        getattr(obj, self.on_change)(self.name)

    def refuse_if_fixed(self, obj, value) -> None:
        """Raise the ``AttributeError`` of a fixed option that is given another value (nothing if assignable)."""
        if self.fixed is not None:
            kind = type(obj).__name__
            raise AttributeError(
                f"{kind}.{self.name} cannot be changed after construction ({self.fixed}); build a new {kind} "
                f"with {self.name}={value!r}"
            )


def _same_option(old, new) -> bool:
    try:
        return bool(old is new or old == new)
    except Exception:  # noqa: BLE001 - values without a boolean equality (tensors) count as changed
        return False


def choice(enum: type[E]):
    """The validator of an :class:`OptionAttribute` that takes a member of ``enum`` (or its string)."""

    def validate(value: object, argument: str) -> E:
        return choose(enum, value, argument)

    validate.enum = enum
    return validate


def option_attributes(cls: type) -> dict[str, OptionAttribute]:
    """Every :class:`OptionAttribute` of ``cls`` and its bases, by name."""
    found: dict[str, OptionAttribute] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, OptionAttribute):
                found[name] = value
    return found


# ---------------------------------------------------------------------- FSVI (ntkgp.fsvi)
class WeightPriorMean(Option):
    """The prior mean :math:`\\mu_0` of FSVI's weights (``prior_mean=`` of :class:`ntkgp.fsvi.FSVI`)."""

    ZERO = "zero"  #: μ0 = 0
    INITIAL = "initial"  #: μ0 = the network's weights when the model is built (a random function at initialization)


class PriorLinearization(Option):
    """Where FSVI's prior function-space covariance is linearized (``prior_linearization=``)."""

    #: about the variational mean μ: p(f_C) = N(f(X_C; μ) + J_μ (μ0 - μ), J_μ diag(s0²) J_μᵀ); never degenerate
    VARIATIONAL_MEAN = "variational_mean"
    #: about the prior mean μ0: p(f_C) = N(f(X_C; μ0), J_μ0 diag(s0²) J_μ0ᵀ), the paper's equation
    PRIOR_MEAN = "prior_mean"


class Predictive(Option):
    """How :meth:`ntkgp.fsvi.FSVI.predict` forms the predictive (``method=``)."""

    LINEARIZED = "linearized"  #: the linearized GP N(f(x; μ), J_μ diag(s²) J_μᵀ) through the likelihood
    MC = "mc"  #: Monte Carlo over weights θ ~ q through the network itself (the paper's predictive)


class ContextKind(Option):
    """Context distributions that :func:`ntkgp.fsvi.train_fsvi` builds from the training inputs (``context=``)."""

    AUTO = "auto"  #: "uniform" for (N, D) inputs, "monochrome" for images (N, channels, H, W)
    UNIFORM = "uniform"  #: uniform in the box of the training inputs
    MONOCHROME = "monochrome"  #: random monochrome images from the training pixels


class KLCovariance(Option):
    """Which covariance over the ``K·C`` outputs at the context points FSVI's function-space KL keeps
    (``kl_covariance=``)."""

    #: all outputs jointly, (K·C)² covariances: the exact KL of the linearized Gaussians (the paper's equation)
    FULL = "full"
    #: each context point's C outputs jointly, the points independent: a sum of K KLs in C dimensions
    BLOCK = "block"
    #: every output independent: a sum of K·C one-dimensional KLs (what the public JAX code of FSVI computes
    #: unless its ``full_ntk`` flag is set)
    DIAGONAL = "diagonal"


def __getattr__(name: str) -> object:
    """``Curvature``, the former name of :class:`CurvatureKind`, still importable with a ``DeprecationWarning``
    (it clashed with the curvature base class :class:`ntkgp.laplace.weight_space.Curvature`)."""
    if name == "Curvature":
        warnings.warn("ntkgp.options.Curvature is deprecated: use ntkgp.options.CurvatureKind (the same enum)",
                      DeprecationWarning, stacklevel=2)
        return CurvatureKind
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
