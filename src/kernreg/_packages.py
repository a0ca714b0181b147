"""Whether a spec's PEP 508 package requirements are met, read from installed metadata."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_results: dict[str, str | None] = {}


def missing_reason(requirement: str) -> str | None:
    """``None`` if ``requirement`` is satisfied by an installed distribution, else why not.

    Nothing is imported: only ``.dist-info`` metadata is read. Results are cached per
    process; :func:`clear_cache` forgets them (after installing a package at run time).
    """
    try:
        return _results[requirement]
    except KeyError:
        pass
    import importlib.metadata

    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        reason: str | None = None  # the requirement does not apply to this interpreter
    else:
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            reason = f"package {req.name} is not installed (needs {requirement})"
        else:
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                reason = f"package {req.name} {version} is installed, needs {requirement}"
            else:
                reason = None
    with _lock:
        _results[requirement] = reason
    return reason


def clear_cache() -> None:
    with _lock:
        _results.clear()
