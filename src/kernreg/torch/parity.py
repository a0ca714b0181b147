"""The parity harness: every implementation of an op that can run here, against the reference.

:func:`check_parity` generates inputs with the op's registered generator (see
:func:`kernreg.torch.inputs`), or takes them from the caller, runs the reference and each
other eligible implementation on fresh copies, and compares:

* the outputs (every tensor in the returned structure), within the tolerance of their dtype;
* the arguments the op writes in place (``mutates``), against the reference's writes;
* every other tensor argument, which must be bitwise unchanged.

An op whose reference takes a keyword ``out`` parameter defaulting to ``None`` declares
that every implementation honours ``out=``: it writes its result into the caller's buffer
(a tensor, or a tuple of them shaped like the result) and returns that buffer. Each case
is then run a second time, with buffers shaped like the reference's result and filled
with NaN: the result must be those buffers, holding values within tolerance (see
:func:`takes_out`).

Which implementations run is the decision kernreg makes for the platform and dtype
(:func:`kernreg.explain`); the others are reported as skipped, with its reasons.
Implementations behind a ``when`` predicate run when the predicate holds for the call.

``interpret=True`` checks the ``triton`` implementations without a GPU: Triton's
interpreter (``TRITON_INTERPRET=1``) runs them on CPU tensors, each decided as if on a
GPU that meets its device requirements (the other gates still apply). No timing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from kernreg._frozen import Frozen
from kernreg.dtypes import normalize_dtype
from kernreg.errors import KernregError
from kernreg.platform import Platform
from kernreg.registry import KernelRegistry
from kernreg.spec import KernelSpec
from kernreg.torch._inputs import DEFAULT_DTYPES, input_spec
from kernreg.torch.arguments import PlatformLike, platform_argument, registry_argument
from kernreg.torch.calls import OUT_PARAMETER, clone_value, device_available, error_text, takes_out

__all__ = [
    "TOLERANCES",
    "ParityError",
    "ParityReport",
    "ParityResult",
    "Tolerance",
    "TritonInterpreterError",
    "check_parity",
    "enable_triton_interpreter",
    "takes_out",
    "torch_device",
    "torch_dtype",
]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
Generator = Callable[[torch.dtype, torch.device, int], Inputs]
Status = Literal["pass", "fail", "error", "skipped"]


class Tolerance(Frozen):
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise."""

    __slots__ = ("atol", "rtol")
    atol: float
    rtol: float

    def __init__(self, atol: float, rtol: float) -> None:
        self._set("atol", float(atol))
        self._set("rtol", float(rtol))

    def __str__(self) -> str:
        return f"atol={self.atol:g}, rtol={self.rtol:g}"


#: Per-dtype tolerances: about two roundings of the dtype (kernels may round an
#: intermediate the reference keeps in float32). Integer and bool outputs compare exactly.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-10, 1e-7),
    "float32": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(1e-3, 2e-3),
    "bfloat16": Tolerance(1e-2, 1.6e-2),
    "float8_e4m3fn": Tolerance(1.25e-1, 1.25e-1),
    "float8_e4m3fnuz": Tolerance(1.25e-1, 1.25e-1),
    "float8_e5m2": Tolerance(2.5e-1, 2.5e-1),
    "float8_e5m2fnuz": Tolerance(2.5e-1, 2.5e-1),
}
_EXACT = Tolerance(0.0, 0.0)


class ParityError(KernregError, ValueError):
    """Parity cannot be checked at all (no reference, no inputs, a device that is not here)."""


class TritonInterpreterError(ParityError):
    """Triton's interpreter cannot run here: triton is missing, or was imported in GPU mode."""

    def __init__(self, message: str, hint: str = "pip install triton") -> None:
        super().__init__(message)
        #: What to do about it, in one line.
        self.hint = hint


#: How interpreted runs are described wherever their results are shown.
INTERPRETED_NOTE = "interpreted by Triton on CPU (device gates simulated, no timing)"
TRITON_INSTALL_HINT = "pip install triton"
_INTERPRET_ENV = "TRITON_INTERPRET"


def enable_triton_interpreter() -> None:
    """Make Triton interpret kernels on CPU tensors in this process (``TRITON_INTERPRET=1``).

    Triton decides when a kernel is defined whether it is compiled or interpreted, so the
    variable must be set before triton (and any kernel module) is imported. Raises
    :class:`TritonInterpreterError` when triton is not installed, or was already imported
    without the variable: its kernels then compile for a GPU, and a fresh process with
    ``TRITON_INTERPRET=1`` (or ``kernreg parity --interpret``) is the way out.
    """
    if sys.modules.get("triton") is None:  # not imported yet (None: imports of it blocked)
        if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
            raise TritonInterpreterError(
                f"interpreted parity needs triton, which is not installed ({TRITON_INSTALL_HINT})",
                TRITON_INSTALL_HINT,
            )
        os.environ[_INTERPRET_ENV] = "1"
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:
        raise TritonInterpreterError(
            f"interpreted parity needs triton, which failed to import: {error_text(exc)}",
            f"reinstall it: {TRITON_INSTALL_HINT}",
        ) from exc
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        interpreting = bool(knobs.runtime.interpret)
    else:  # triton before 3.3 reads the variable itself
        interpreting = os.environ.get(_INTERPRET_ENV, "").strip().lower() in ("1", "true", "on")
    if not interpreting:
        raise TritonInterpreterError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels compile "
            "for a GPU: set TRITON_INTERPRET=1 before anything imports triton (or run "
            "`kernreg parity --interpret` in a fresh process)",
            "set TRITON_INTERPRET=1 before triton is imported",
        )


def simulated_platform(spec: KernelSpec) -> Platform:
    """A platform that meets ``spec``'s first device requirement (CPU when it has none)."""
    source = "simulated for the Triton interpreter"
    if not spec.requires:
        return Platform("cpu", source=source)
    requirement = min(spec.requires, key=lambda r: r.sort_key())
    arch = requirement.min_arch or requirement.max_arch
    name = min(requirement.archs) if requirement.archs else None
    if name is not None and arch is None and requirement.device == "cuda":
        return Platform.parse(f"cuda:{name}", source=source)
    return Platform(requirement.device, arch=arch, arch_name=name, source=source)


class ParityResult(Frozen):
    """One implementation on one dtype and input case: its status and the largest errors."""

    __slots__ = (
        "implementation",
        "dtype",
        "case",
        "status",
        "max_abs_error",
        "max_rel_error",
        "tolerance",
        "message",
    )
    implementation: str
    dtype: str
    case: int | None
    status: Status
    max_abs_error: float | None
    max_rel_error: float | None
    tolerance: Tolerance | None
    message: str

    def __init__(
        self,
        implementation: str,
        dtype: str,
        case: int | None,
        status: Status,
        *,
        max_abs_error: float | None = None,
        max_rel_error: float | None = None,
        tolerance: Tolerance | None = None,
        message: str = "",
    ) -> None:
        self._set("implementation", implementation)
        self._set("dtype", dtype)
        self._set("case", case)
        self._set("status", status)
        self._set("max_abs_error", max_abs_error)
        self._set("max_rel_error", max_rel_error)
        self._set("tolerance", tolerance)
        self._set("message", message)

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "skipped")

    def describe(self) -> dict[str, object]:
        return {
            "implementation": self.implementation,
            "dtype": self.dtype,
            "case": self.case,
            "status": self.status,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "atol": None if self.tolerance is None else self.tolerance.atol,
            "rtol": None if self.tolerance is None else self.tolerance.rtol,
            "message": self.message,
        }


class ParityReport(Frozen):
    """Every result of :func:`check_parity` for one op, in a fixed order."""

    __slots__ = ("op", "platform", "reference", "results", "interpreted", "out_form")
    op: str
    platform: Platform
    reference: str
    results: tuple[ParityResult, ...]
    #: The ``triton`` implementations ran in Triton's interpreter, on CPU tensors.
    interpreted: bool
    #: The op takes ``out=``: every case also ran with output buffers (:func:`takes_out`).
    out_form: bool

    def __init__(
        self,
        op: str,
        platform: Platform,
        reference: str,
        results: tuple[ParityResult, ...],
        *,
        interpreted: bool = False,
        out_form: bool = False,
    ) -> None:
        self._set("op", op)
        self._set("platform", platform)
        self._set("reference", reference)
        self._set("results", results)
        self._set("interpreted", interpreted)
        self._set("out_form", out_form)

    @property
    def ok(self) -> bool:
        """No implementation failed or raised (skipped ones do not count)."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[ParityResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    @property
    def checked(self) -> tuple[str, ...]:
        """Implementations that ran at least once, sorted."""
        return tuple(sorted({r.implementation for r in self.results if r.status != "skipped"}))

    @property
    def skipped(self) -> dict[str, str]:
        """Implementation -> why it could not run (for dtypes where it never ran)."""
        out: dict[str, str] = {}
        for r in self.results:
            if r.status == "skipped":
                out.setdefault(r.implementation, f"{r.dtype}: {r.message}")
        return out

    def describe(self) -> dict[str, object]:
        return {
            "op": self.op,
            "platform": str(self.platform),
            "reference": self.reference,
            "interpreted": self.interpreted,
            "out_form": self.out_form,
            "ok": self.ok,
            "results": [r.describe() for r in self.results],
        }

    def __str__(self) -> str:
        where = INTERPRETED_NOTE if self.interpreted else f"on {self.platform}"
        form = ", with and without out=" if self.out_form else ""
        head = f"parity of {self.op} {where} (reference {self.reference}{form}): " + (
            "ok" if self.ok else f"{len(self.failures)} failing"
        )
        lines = [head]
        for r in self.results:
            err = "" if r.max_abs_error is None else f" max abs {r.max_abs_error:.3g}"
            if r.max_rel_error is not None:
                err += f" max rel {r.max_rel_error:.3g}"
            case = "" if r.case is None else f" case {r.case}"
            lines.append(
                f"  {r.status:<7} {r.implementation:<16} {r.dtype:<9}{case}{err}"
                + (f"  {r.message}" if r.message else "")
            )
        return "\n".join(lines)


# --- dtypes and devices ---------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a kernreg dtype name (``bf16`` and other aliases accepted)."""
    canonical = normalize_dtype(name)
    value = getattr(torch, canonical, None)
    if not isinstance(value, torch.dtype):
        raise ParityError(f"torch {torch.__version__} has no dtype {canonical!r}")
    return value


def torch_device(platform: Platform) -> torch.device:
    """The torch device a platform's tensors live on (ROCm GPUs are ``cuda`` devices in torch)."""
    kind = "cuda" if platform.device == "hip" else platform.device
    index = platform.index
    return torch.device(kind) if index is None or kind == "cpu" else torch.device(kind, index)


# --- comparing --------------------------------------------------------------------------------


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _leaves(value[key], f"{path}[{key!r}]")
    else:
        yield path, value


class Diff:
    """What comparing outputs found: the largest absolute and relative errors, and every
    value, shape or structure outside the tolerance (one line each)."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.problems: list[str] = []


def compare(
    path: str, actual: Any, expected: Any, tolerances: Mapping[str, Tolerance], diff: Diff
) -> None:
    """Compare ``actual`` with ``expected`` (tensors, or tuples, lists and mappings of them)
    within the per-dtype ``tolerances``, adding what differs to ``diff`` under ``path``."""
    if isinstance(expected, (tuple, list, Mapping)):
        _compare_structure(path, actual, expected, tolerances, diff)
        return
    if not isinstance(expected, torch.Tensor):
        if isinstance(actual, torch.Tensor) or actual != expected:
            diff.problems.append(f"{path}: expected {expected!r}, got {_short(actual)}")
        return
    if not isinstance(actual, torch.Tensor):
        diff.problems.append(f"{path}: expected a tensor, got {_short(actual)}")
        return
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        diff.problems.append(
            f"{path}: expected {tuple(expected.shape)} {expected.dtype}, "
            f"got {tuple(actual.shape)} {actual.dtype}"
        )
        return
    if actual.numel() == 0:
        return
    name = str(expected.dtype).removeprefix("torch.")
    tol = tolerances.get(name, _EXACT)
    if not (expected.is_floating_point() or expected.is_complex()):
        if not torch.equal(actual, expected):
            diff.problems.append(f"{path}: {name} values differ")
        return
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    both_nan = a.isnan() & e.isnan()
    err = (a - e).abs().masked_fill(both_nan, 0.0)
    err = err.masked_fill(a == e, 0.0)  # equal infinities
    # A NaN on one side only is infinitely wrong; left NaN, it would vanish from max().
    err = err.masked_fill(err.isnan(), math.inf)
    allowed = tol.atol + tol.rtol * e.abs()
    bad = ~(err <= allowed)  # NaN in only one of them is bad
    max_abs = float(err.max())
    rel = (err / e.abs().clamp_min(tol.atol or 1e-30)).max()
    diff.max_abs = max(diff.max_abs, max_abs)
    diff.max_rel = max(diff.max_rel, float(rel))
    if bool(bad.any()):
        count = int(bad.sum())
        # The worst value outside the tolerance: by how much it misses, not just where.
        excess = (err - allowed).masked_fill(~bad, -math.inf)
        where = tuple(int(i) for i in torch.unravel_index(excess.argmax(), a.shape))
        digits = _significant_digits(expected.dtype)
        got, want, abs_err = float(a[where]), float(e[where]), float(err[where])
        rel_err = abs_err / abs(want) if want else math.inf
        diff.problems.append(
            f"{path}: {count} of {a.numel()} values outside {tol} "
            f"(max abs error {max_abs:.3g}, max rel error {float(rel):.3g}; "
            f"worst at {where}: got {got:.{digits}g}, expected {want:.{digits}g}, "
            f"abs error {abs_err:.3g}, rel error {rel_err:.3g})"
        )


def _significant_digits(dtype: torch.dtype) -> int:
    """Digits that tell apart any two values of ``dtype`` (9 for float32, 17 for float64)."""
    real = dtype.to_real() if dtype.is_complex else dtype
    mantissa_bits = 1 - math.log2(torch.finfo(real).eps)
    return math.ceil(1 + mantissa_bits * math.log10(2))


def _compare_structure(
    path: str, actual: Any, expected: Any, tolerances: Mapping[str, Tolerance], diff: Diff
) -> None:
    """Tuples, lists and mappings: the same kind and keys, then leaf by leaf."""
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            diff.problems.append(
                f"{path}: expected a mapping with keys {sorted(expected, key=str)}, got {_short(actual)}"
            )
            return
        for key in sorted(expected, key=str):
            compare(f"{path}[{key!r}]", actual[key], expected[key], tolerances, diff)
        return
    if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
        diff.problems.append(
            f"{path}: expected a {type(expected).__name__} of {len(expected)}, got {_short(actual)}"
        )
        return
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        compare(f"{path}[{i}]", a, e, tolerances, diff)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


# --- running ----------------------------------------------------------------------------------

#: The message of a passing result whose case also ran with ``out=``.
OUT_FORM_NOTE = "with and without out="


class _Case:
    """One set of inputs, bound to the reference's parameter names."""

    def __init__(self, signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]):
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.signature = signature
        bound = signature.bind(*self.args, **self.kwargs)
        self.names = list(bound.arguments)
        #: Run a second time with output buffers (inputs that pass out= themselves are not).
        self.with_out = takes_out(signature) and OUT_PARAMETER not in bound.arguments

    def fresh(self) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
        """Cloned args and kwargs, and the cloned values by parameter name."""
        args, kwargs = clone_value(self.args), clone_value(self.kwargs)
        bound = self.signature.bind(*args, **kwargs)
        return args, kwargs, dict(bound.arguments)


def _run(
    impl: Callable[..., Any],
    case: _Case,
    mutates: Sequence[str],
    originals: dict[str, Any],
) -> tuple[Any, dict[str, Any], list[str]]:
    """Call ``impl`` on fresh copies; its output, the mutated arguments and stray writes."""
    args, kwargs, by_name = case.fresh()
    out = impl(*args, **kwargs)
    stray = _stray_writes(by_name, mutates, originals)
    return out, {name: by_name[name] for name in mutates if name in by_name}, stray


def _stray_writes(
    by_name: dict[str, Any], mutates: Sequence[str], originals: dict[str, Any]
) -> list[str]:
    """The tensor arguments a call changed although the op does not declare them mutated."""
    stray = []
    for name, value in by_name.items():
        if name in mutates:
            continue
        for path, leaf in _leaves(value, name):
            if isinstance(leaf, torch.Tensor):
                original = dict(_leaves(originals[name], name))[path]
                if not _bitwise_equal(leaf, original):
                    stray.append(f"{path} was modified but the op does not declare it mutated")
    return stray


def _out_buffers(expected: Any) -> Any:
    """Buffers shaped like the reference's result, filled with NaN (unwritten values show)."""
    if isinstance(expected, torch.Tensor):
        buffer = torch.empty_like(expected, memory_format=torch.contiguous_format)
        if buffer.is_floating_point() or buffer.is_complex():
            buffer.fill_(math.nan)
        return buffer
    if isinstance(expected, (tuple, list)) and expected:
        return tuple(_out_buffers(item) for item in expected)
    raise ParityError(
        f"the op takes out=, but its reference returned {_short(expected)}, which no output "
        "buffer can hold: out= is for ops that return a tensor or a tuple of tensors"
    )


def _check_out_form(
    impl: Callable[..., Any],
    case: _Case,
    mutates: Sequence[str],
    originals: dict[str, Any],
    expected: Any,
    expected_mutated: dict[str, Any],
    tolerances: Mapping[str, Tolerance],
    diff: Diff,
) -> None:
    """Call ``impl`` with ``out=`` buffers: its result must be those buffers (the same
    memory, shape and dtype), holding the expected values."""
    buffers = _out_buffers(expected)
    args, kwargs, by_name = case.fresh()
    result = impl(*args, **kwargs, **{OUT_PARAMETER: buffers})
    path = f"output ({OUT_PARAMETER}=)"
    problems = len(diff.problems)
    compare(path, result, expected, tolerances, diff)
    if len(diff.problems) == problems:  # the structure matches: leaf by leaf
        for (where, got), (_, buffer) in zip(
            _leaves(result, path), _leaves(buffers, path), strict=True
        ):
            if not isinstance(got, torch.Tensor) or not (
                got.data_ptr() == buffer.data_ptr()
                and got.shape == buffer.shape
                and got.dtype == buffer.dtype
            ):
                diff.problems.append(
                    f"{where} is not the {OUT_PARAMETER}= buffer it was given: the result "
                    f"must be written into {OUT_PARAMETER} and {OUT_PARAMETER} returned"
                )
    for name in mutates:
        if name in expected_mutated:
            got = by_name.get(name)
            compare(f"{name} ({OUT_PARAMETER}=)", got, expected_mutated[name], tolerances, diff)
    for problem in _stray_writes(by_name, mutates, originals):
        diff.problems.append(f"{problem} ({OUT_PARAMETER}=)")


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def _dtype_of_inputs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    for _, leaf in _leaves((tuple(args), dict(kwargs)), ""):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return str(leaf.dtype).removeprefix("torch.")
    for _, leaf in _leaves((tuple(args), dict(kwargs)), ""):
        if isinstance(leaf, torch.Tensor):
            return str(leaf.dtype).removeprefix("torch.")
    return "float32"


def check_parity(
    op: Any,
    *,
    inputs: Generator | Inputs | None = None,
    dtypes: Sequence[str] | None = None,
    platform: PlatformLike = None,
    registry: KernelRegistry | None = None,
    seeds: Sequence[int] = (0, 1),
    tolerances: Mapping[str, Tolerance] | None = None,
    mutates: Sequence[str] | None = None,
    interpret: bool = False,
) -> ParityReport:
    """Run every implementation of ``op`` eligible here against its reference.

    ``op`` is an op id or an op object. ``inputs`` is a generator
    ``(dtype, device, seed) -> (args, kwargs)`` or one fixed ``(args, kwargs)``; by
    default the generator registered for the op. ``dtypes`` default to the generator's
    (fixed inputs: the dtype of their first floating tensor). ``platform`` decides
    eligibility and the device of generated tensors (default: this machine).
    ``tolerances`` override :data:`TOLERANCES` per dtype; ``mutates`` overrides the
    parameters the op writes in place.

    ``interpret=True`` runs only the ``triton`` implementations, through Triton's
    interpreter on CPU tensors (see :func:`enable_triton_interpreter`), each gated as if
    on a GPU that meets its device requirements, or on ``platform`` when one is given.
    """
    op_id: str = op if isinstance(op, str) else op.op_id
    reg = getattr(op, "registry", None) if registry is None and not isinstance(op, str) else None
    reg = reg if isinstance(reg, KernelRegistry) else registry_argument(registry)
    target = platform_argument(platform)
    plat = target or reg.platform
    reg.explain(op_id, platform=plat)  # loads plugins; unknown ops raise OpNotFoundError
    reference = reg.reference(op_id)
    if reference is None:
        raise ParityError(f"op '{op_id}' has no reference implementation to check against")
    if interpret:
        enable_triton_interpreter()
        plat = target or Platform("cpu", torch_version=str(torch.__version__), source="host")
    device = torch.device("cpu") if interpret else torch_device(plat)
    if not device_available(device):
        raise ParityError(
            f"cannot run op '{op_id}' for platform {plat}: torch has no {device.type} device "
            "here (use `kernreg explain --platform` to see decisions for other machines)"
        )
    declared = input_spec(op_id)
    fixed: Inputs | None = None
    generate: Generator | None = None
    if inputs is None:
        if declared is None:
            raise ParityError(
                f"no input generator registered for op '{op_id}': declare one with "
                "@kernreg.torch.inputs(op_id) or pass inputs="
            )
        generate = declared.load()
    elif callable(inputs):
        generate = inputs
    else:
        fixed = (tuple(inputs[0]), dict(inputs[1]))
    in_place = tuple(mutates) if mutates is not None else (declared.mutates if declared else ())
    tols = {**TOLERANCES, **(tolerances or {})}
    if dtypes is not None:
        names = tuple(normalize_dtype(d) for d in dtypes)
    elif fixed is not None:
        names = (_dtype_of_inputs(*fixed),)
    else:
        names = declared.dtypes if declared is not None and inputs is None else DEFAULT_DTYPES

    reference_impl = reference.load()
    signature = inspect.signature(reference_impl)
    results: list[ParityResult] = []
    out_form = False
    for dtype in names:
        cases = _cases(op_id, fixed, generate, dtype, device, seeds, signature)
        out_form = out_form or any(case.with_out for _, case in cases)
        if interpret:
            results.extend(
                _check_interpreted(reg, op_id, target, dtype, cases, reference_impl, in_place, tols)
            )
            results.extend(
                _check_reference(reference, dtype, cases, reference_impl, in_place, tols)
            )
            continue
        decision = reg.explain(op_id, platform=plat, dtypes=(dtype,))
        for candidate in decision.candidates:
            spec = candidate.spec
            if spec.reference:
                continue
            if candidate.status == "rejected":
                results.append(
                    ParityResult(
                        spec.label, dtype, None, "skipped", message="; ".join(candidate.reasons)
                    )
                )
                continue
            results.extend(
                _check_one(reg, op_id, spec, plat, dtype, cases, reference_impl, in_place, tols)
            )
        results.extend(_check_reference(reference, dtype, cases, reference_impl, in_place, tols))
    return ParityReport(
        op_id,
        plat,
        reference.label,
        tuple(results),
        interpreted=interpret,
        out_form=out_form,
    )


def _check_interpreted(
    reg: KernelRegistry,
    op_id: str,
    target: Platform | None,
    dtype: str,
    cases: list[tuple[int | None, _Case]],
    reference_impl: Callable[..., Any],
    mutates: Sequence[str],
    tolerances: Mapping[str, Tolerance],
) -> list[ParityResult]:
    """Every ``triton`` implementation of ``op_id``, gated on ``target`` or a platform
    that meets its requirements, run on the (CPU) cases through the interpreter."""
    out: list[ParityResult] = []
    for spec in sorted(reg.get(op_id), key=KernelSpec.sort_key):
        if spec.backend != "triton" or spec.reference:
            continue
        simulated = target or simulated_platform(spec)
        decision = reg.explain(op_id, platform=simulated, dtypes=(dtype,))
        candidate = decision.candidate(spec.backend, spec.variant)
        if candidate.status == "rejected":
            reasons = "; ".join(candidate.reasons)
            out.append(
                ParityResult(
                    spec.label, dtype, None, "skipped", message=f"on {simulated}: {reasons}"
                )
            )
            continue
        out.extend(
            _check_one(
                reg, op_id, spec, simulated, dtype, cases, reference_impl, mutates, tolerances
            )
        )
    return out


def _cases(
    op_id: str,
    fixed: Inputs | None,
    generate: Generator | None,
    dtype: str,
    device: torch.device,
    seeds: Sequence[int],
    signature: inspect.Signature,
) -> list[tuple[int | None, _Case]]:
    """The input cases for ``dtype``; a generator that raises, or inputs the reference
    cannot take, are a :class:`ParityError` naming the op."""
    if fixed is not None:
        raw: list[tuple[int | None, Inputs]] = [(None, fixed)]
    else:
        assert generate is not None
        td = torch_dtype(dtype)
        raw = []
        for seed in seeds:
            try:
                raw.append((seed, generate(td, device, seed)))
            except Exception as exc:
                raise ParityError(
                    f"the input generator of op '{op_id}' {error_text(exc)} "
                    f"(dtype {dtype}, seed {seed})"
                ) from exc
    cases: list[tuple[int | None, _Case]] = []
    for case, (args, kwargs) in raw:
        try:
            cases.append((case, _Case(signature, args, kwargs)))
        except TypeError as exc:
            raise ParityError(
                f"the inputs for op '{op_id}' do not fit its reference{signature}: {exc}"
            ) from exc
    return cases


def _check_reference(
    reference: KernelSpec,
    dtype: str,
    cases: list[tuple[int | None, _Case]],
    impl: Callable[..., Any],
    mutates: Sequence[str],
    tolerances: Mapping[str, Tolerance],
) -> list[ParityResult]:
    """The reference must at least leave the arguments it does not declare untouched, and,
    when the op takes ``out=``, give its own result in the buffers it is given."""
    problems: list[str] = []
    for seed, case in cases:
        originals = case.fresh()[2]
        try:
            result, mutated, stray = _run(impl, case, mutates, originals)
            if case.with_out:
                diff = Diff()
                _check_out_form(impl, case, mutates, originals, result, mutated, tolerances, diff)
                stray = stray + diff.problems
        except Exception as exc:
            return [ParityResult(reference.label, dtype, seed, "error", message=error_text(exc))]
        problems.extend(stray)
    status: Status = "fail" if problems else "pass"
    note = "reference" + (f", {OUT_FORM_NOTE}" if any(c.with_out for _, c in cases) else "")
    return [ParityResult(reference.label, dtype, None, status, message="; ".join(problems) or note)]


def _check_one(
    reg: KernelRegistry,
    op_id: str,
    spec: KernelSpec,
    platform: Platform,
    dtype: str,
    cases: list[tuple[int | None, _Case]],
    reference_impl: Callable[..., Any],
    mutates: Sequence[str],
    tolerances: Mapping[str, Tolerance],
) -> list[ParityResult]:
    out: list[ParityResult] = []
    impl: Callable[..., Any] | None = None
    tol = tolerances.get(dtype)
    for seed, case in cases:
        if spec.when is not None:
            verdict = reg.explain(
                op_id, platform=platform, dtypes=(dtype,), call=(case.args, case.kwargs)
            ).candidate(spec.backend, spec.variant)
            if not verdict.eligible:
                out.append(
                    ParityResult(
                        spec.label, dtype, seed, "skipped", message="; ".join(verdict.reasons)
                    )
                )
                continue
        if impl is None:  # imported only once some case may run it
            try:
                impl = spec.load()
            except Exception as exc:
                return [ParityResult(spec.label, dtype, None, "error", message=error_text(exc))]
        originals = case.fresh()[2]
        try:
            expected_out, expected_mut, _ = _run(reference_impl, case, mutates, originals)
        except Exception as exc:
            # The reference's own result reports the error; this one is not to blame.
            message = f"nothing to compare with: the reference {error_text(exc)}"
            out.append(ParityResult(spec.label, dtype, seed, "skipped", message=message))
            continue
        try:
            actual_out, actual_mut, stray = _run(impl, case, mutates, originals)
        except Exception as exc:
            out.append(ParityResult(spec.label, dtype, seed, "error", message=error_text(exc)))
            continue
        diff = Diff()
        compare("output", actual_out, expected_out, tolerances, diff)
        for name in mutates:
            if name in expected_mut:
                compare(name, actual_mut.get(name), expected_mut[name], tolerances, diff)
        diff.problems.extend(stray)
        if case.with_out:
            try:
                _check_out_form(
                    impl, case, mutates, originals, expected_out, expected_mut, tolerances, diff
                )
            except Exception as exc:
                message = f"with {OUT_PARAMETER}=: {error_text(exc)}"
                out.append(ParityResult(spec.label, dtype, seed, "error", message=message))
                continue
        out.append(
            ParityResult(
                spec.label,
                dtype,
                seed,
                "fail" if diff.problems else "pass",
                max_abs_error=_finite(diff.max_abs),
                max_rel_error=_finite(diff.max_rel),
                tolerance=tol,
                message="; ".join(diff.problems) or (OUT_FORM_NOTE if case.with_out else ""),
            )
        )
    return out


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
