"""Whether a spec's PEP 508 package requirements are met, read from installed metadata or
*assumed* (``KERNREG_ASSUME_PACKAGES``: decide for a target machine, like ``--platform``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["AssumedPackage", "assuming", "clear_cache", "missing_reason", "parse_assumed"]


@functools.cache
def missing_reason(requirement: str) -> str | None:
    """``None`` if ``requirement`` is satisfied by an installed distribution, else why not.
    Only ``.dist-info`` metadata is read (0.8 ms); answers are cached until :func:`clear_cache`."""
    import importlib.metadata

    from packaging.requirements import Requirement

    req = Requirement(requirement)
    try:
        version: str | None = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return _unmet(req, requirement, version, "installed")


def _unmet(req: Any, requirement: str, version: str | None, how: str) -> str | None:
    """Why ``version`` (``None``: not installed) does not meet ``requirement``, or ``None``."""
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return None  # the requirement does not apply to this interpreter
    if version is None:
        return f"package {req.name} is not installed (needs {requirement})"
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return f"package {req.name} {version} is {how}, needs {requirement}"
    return None


def clear_cache() -> None:
    """Forget every package found or missing (a package was installed or removed at run
    time): the assumed-version gates, which fall back to these results, are rebuilt too."""
    missing_reason.cache_clear()
    _assuming.cache_clear()
    importlib.invalidate_caches()  # importlib.metadata's own path caches


# A distribution name as PEP 508 spells it.
DIST_NAME_RE = re.compile(r"(?i)[a-z0-9]|[a-z0-9][a-z0-9._-]*[a-z0-9]")


@dataclasses.dataclass(frozen=True, slots=True)
class AssumedPackage:
    """``name==version``: package gates see this version, whatever is installed here. ``name``
    is canonical (PEP 503); ``source``, where the assumption came from, is not compared."""

    name: str
    version: str
    source: str = dataclasses.field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def parse_assumed(items: Iterable[str], source: str = "") -> tuple[AssumedPackage, ...]:
    """``["triton==3.4", ...]`` (PEP 440 versions) as assumptions sorted by name;
    ``ValueError`` says what is wrong, such as a package assumed at two versions."""
    items = list(items)
    if not items:  # the usual case: packaging (about 20 ms to import) is not needed
        return ()
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    by_name: dict[str, AssumedPackage] = {}
    for item in items:
        name, sep, version = (part.strip() for part in item.partition("=="))
        if not sep or not name or not version:
            raise ValueError(f"{item!r} is not 'name==version' (e.g. 'triton==3.4')")
        if DIST_NAME_RE.fullmatch(name) is None:
            raise ValueError(f"{name!r} is not a distribution name")
        canonical = canonicalize_name(name)
        try:
            Version(version)
        except InvalidVersion:
            raise ValueError(f"{version!r} is not a version (PEP 440)") from None
        assumed = AssumedPackage(canonical, version, source)
        previous = by_name.setdefault(canonical, assumed)
        if previous != assumed:
            raise ValueError(f"{canonical} is assumed twice ({previous}, {assumed})")
    return tuple(by_name[name] for name in sorted(by_name))


def assuming(
    assumed: Iterable[AssumedPackage], fallback: Callable[[str], str | None] = missing_reason
) -> Callable[[str], str | None]:
    """A :func:`missing_reason` that sees the ``assumed`` versions; other packages go to
    ``fallback`` (installed metadata). One function, with its cache, per assumption set."""
    return _assuming(tuple((a.name, a.version, a.source) for a in assumed), fallback)


# Cached so that each decision does not parse its requirements afresh (26 µs each).
@functools.lru_cache(maxsize=32)
def _assuming(
    assumed: tuple[tuple[str, str, str], ...], fallback: Callable[[str], str | None]
) -> Callable[[str], str | None]:
    versions = {name: (version, source) for name, version, source in assumed}

    @functools.cache
    def reason(requirement: str) -> str | None:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name

        req = Requirement(requirement)
        found = versions.get(canonicalize_name(req.name))
        if found is None:
            return fallback(requirement)
        version, source = found
        return _unmet(req, requirement, version, f"assumed ({source})" if source else "assumed")

    return reason
