"""The autotune policy: choose among eligible implementations by measured speed.

Opt-in (``KERNREG_POLICY=autotune``, op globs, or ``kernreg.op(..., autotune=True)``). The
eligible implementations of a call are measured once per op, platform, candidate set,
dtypes and shape bucket, and the results kept in the tuning store (:mod:`kernreg.tuning`)
for later processes and other ranks. The measuring itself lives in :mod:`kernreg.torch.tune`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kernreg.measurement import Measurement
from kernreg.platform import Platform
from kernreg.spec import KernelSpec

__all__ = [
    "NOISE_FRACTION",
    "choose_measured",
    "implementations_key",
    "platform_key",
    "shape_bucket",
]

#: Medians closer to the fastest than this fraction of it (or than the fastest one's
#: spread, whichever is larger) count as equally fast: priority decides among them.
NOISE_FRACTION = 0.05


def _bucket_dim(n: int) -> int:
    """Round a dimension up to a power of two (0 and 1 stay), so nearby shapes share a bucket."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def shape_bucket(names: Sequence[str], values: Sequence[Any]) -> str:
    """The shape bucket of a call's dispatch arguments: ``x=1x4096`` per argument with a
    ``shape``, each dimension rounded up to a power of two."""
    parts = []
    for name, value in zip(names, values, strict=True):
        shape = getattr(value, "shape", None)
        if shape is None:
            continue
        parts.append(f"{name}=" + "x".join(str(_bucket_dim(int(n))) for n in shape))
    return ",".join(parts) or "-"


def platform_key(platform: Platform) -> str:
    """What makes two machines tune alike: device, architecture and runtime versions."""
    runtime = platform.runtime_version or "-"
    return f"{platform}|torch={platform.torch_version or '-'}|runtime={runtime}"


def implementations_key(specs: Sequence[KernelSpec]) -> str:
    """The candidate set and where each came from: a new version of any means measuring again."""
    parts = []
    for spec in sorted(specs, key=lambda s: (s.backend, s.variant)):
        origin = spec.origin
        dist = f"@{origin.distribution} {origin.version}" if origin and origin.distribution else ""
        parts.append(f"{spec.label}={spec.target_name}{dist}")
    return ";".join(parts)


def choose_measured(
    candidates: Sequence[KernelSpec], measured: Mapping[str, Measurement]
) -> KernelSpec:
    """The fastest candidate, or among those within noise of it the highest priority, then
    the faster median, then the label: nothing but the recorded numbers decides."""
    best = min(candidates, key=lambda c: measured[c.label].median_ns)
    fastest = measured[best.label].median_ns
    noise = max(measured[best.label].spread_ns, NOISE_FRACTION * fastest)
    close = [c for c in candidates if measured[c.label].median_ns <= fastest + noise]
    return min(close, key=lambda c: (-c.priority, measured[c.label].median_ns, c.label))
