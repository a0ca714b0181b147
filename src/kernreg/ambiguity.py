"""The static overlap check behind ``kernreg check``: same-op, same-priority specs that some
platform and call could both find eligible (:func:`kernreg.registry.find_ambiguities`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kernreg.platform import Platform, Requirement
from kernreg.spec import KernelSpec

__all__ = ["Ambiguity", "find_ambiguities_in"]


@dataclasses.dataclass(frozen=True, slots=True)
class Ambiguity:
    """Two same-op, same-priority specs that some platform and call could both satisfy."""

    op: str
    first: KernelSpec
    second: KernelSpec
    reason: str

    def __str__(self) -> str:
        return (
            f"op '{self.op}': '{self.first.label}' ({self.first.origin}) and '{self.second.label}' "
            f"({self.second.origin}) share priority {self.first.priority} and can both be eligible: "
            f"{self.reason}"
        )

    def describe(self) -> dict[str, object]:
        return {
            "op": self.op,
            "first": self.first.label,
            "second": self.second.label,
            "priority": self.first.priority,
            "first_origin": None if self.first.origin is None else str(self.first.origin),
            "second_origin": None if self.second.origin is None else str(self.second.origin),
            "reason": self.reason,
        }


def requirements_overlap(a: Requirement, b: Requirement) -> bool:
    """Whether some platform satisfies both requirements."""
    if a.device != b.device:
        return False
    # Where both hold, they hold on one of these: a named target (a CUDA name at the
    # capability it runs from, sm_100f at 10.0; a name of no known capability, gfx942, at
    # each bound), or the device at a bound of either window.
    bounds = [None, *(x for r in (a, b) for x in (r.min_arch, r.max_arch) if x is not None)]
    named = [Platform(a.device), *(_named(a.device, name) for name in sorted(a.archs | b.archs))]
    candidates = [p if p.arch is not None else p.replace(arch=x) for p in named for x in bounds]
    return any(a.allows(p) and b.allows(p) for p in candidates)


def _named(device: str, name: str) -> Platform:
    try:
        return Platform.parse(f"{device}:{name}")
    except ValueError:  # a name Platform.parse does not read: no known capability
        return Platform(device, arch_name=name)


def _overlap_reason(a: KernelSpec, b: KernelSpec) -> str | None:
    if a.requires and b.requires:
        shared = [
            f"{ra} & {rb}"
            for ra in sorted(a.requires, key=Requirement.sort_key)
            for rb in sorted(b.requires, key=Requirement.sort_key)
            if requirements_overlap(ra, rb)
        ]
        if not shared:
            return None
        parts = ["devices: " + ", ".join(shared)]
    else:
        parts = ["devices: " + ("one runs anywhere" if a.requires or b.requires else "any")]
    common = a.dtypes & b.dtypes if a.dtypes and b.dtypes else a.dtypes or b.dtypes
    if a.dtypes and b.dtypes and not common:
        return None
    parts.append("dtypes: " + (", ".join(sorted(common)) or "any"))
    if a.when is not None or b.when is not None:
        parts.append("when predicates may both hold")
    return "; ".join(parts)


def find_ambiguities_in(specs_by_op: Mapping[str, Sequence[KernelSpec]]) -> tuple[Ambiguity, ...]:
    """Every pair of non-reference specs of one op and priority that can both be eligible."""
    found = []
    for op in sorted(specs_by_op):
        candidates = sorted(
            (s for s in specs_by_op[op] if not s.reference), key=KernelSpec.sort_key
        )
        for i, first in enumerate(candidates):
            for second in candidates[i + 1 :]:
                if second.priority != first.priority:
                    break
                reason = _overlap_reason(first, second)
                if reason is not None:
                    found.append(Ambiguity(op, first, second, reason))
    return tuple(found)
