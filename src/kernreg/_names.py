"""Validation of the names kernreg keys on: op ids, backends, variants, devices, traits."""

from __future__ import annotations

import re

from kernreg.errors import InvalidSpecError

_SEGMENT = r"[a-z][a-z0-9_]*"
NAME_RE = re.compile(_SEGMENT)
OP_ID_RE = re.compile(rf"{_SEGMENT}(?:\.{_SEGMENT})+")
# Globs over op ids: the characters of an op id plus fnmatch's '*', '?' and '[...]'.
OP_GLOB_RE = re.compile(r"(?:[a-z0-9_.*?!-]|\[!?[a-z0-9_.-]+\])+")  # each [ closed
VARIANT_RE = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def check_op_id(op: object, field: str = "op id") -> str:
    if not isinstance(op, str) or OP_ID_RE.fullmatch(op) is None:
        raise InvalidSpecError(
            field,
            op,
            "expected lower-case dotted segments like 'layernorm.rmsnorm' "
            "(each [a-z][a-z0-9_]*, at least two)",
        )
    return op


def check_name(value: object, field: str) -> str:
    if not isinstance(value, str) or NAME_RE.fullmatch(value) is None:
        raise InvalidSpecError(field, value, "expected a lower-case name matching [a-z][a-z0-9_]*")
    return value


def check_variant(value: object, field: str = "variant") -> str:
    if not isinstance(value, str) or (value and VARIANT_RE.fullmatch(value) is None):
        raise InvalidSpecError(
            field, value, "expected '' or a lower-case name matching [a-z0-9][a-z0-9_.-]*"
        )
    return value


def check_op_glob(value: object, field: str) -> str:
    # A pattern without wildcards only ever matches itself, so it must be an op id
    # ('KERNREG_STRICT=2' or a pin on 'layernorm' would otherwise silently match nothing).
    if (
        not isinstance(value, str)
        or OP_GLOB_RE.fullmatch(value) is None
        or (not any(ch in value for ch in "*?[") and OP_ID_RE.fullmatch(value) is None)
    ):
        raise InvalidSpecError(
            field, value, "expected an op id or a glob over op ids like 'layernorm.*'"
        )
    return value


def label(backend: str, variant: str) -> str:
    """How an implementation key is shown: ``backend``, or ``backend/variant``."""
    return f"{backend}/{variant}" if variant else backend


def display_label(implementation: str, reference: bool) -> str:
    """An implementation's label as tables and messages show it: ``torch (reference)``."""
    return f"{implementation} (reference)" if reference else implementation


def parse_label(text: str, field: str) -> tuple[str, str | None]:
    """Parse ``backend`` or ``backend/variant``; a bare backend leaves the variant open."""
    backend, sep, variant = text.strip().partition("/")
    check_name(backend, field)
    if sep:
        check_variant(variant, field)
        return backend, variant
    return backend, None
