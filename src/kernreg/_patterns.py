"""Regular expressions compiled on first use: compiling kernreg's own at import would cost
about 2 ms of the budget of ``import kernreg``."""

from __future__ import annotations

from kernreg._typing import Any

_METHODS = ("fullmatch", "match", "search", "findall", "finditer", "sub", "split")


class LazyPattern:
    """``re.compile(pattern, flags)``, compiled when first used; from then on its methods
    are the compiled pattern's own (kept on the instance: no extra call per use)."""

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self.pattern = pattern
        self.flags = flags

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set yet: the first use (or a name no pattern has).
        import re  # on first use: `re` (with `enum`) costs ~4 ms of `import kernreg`

        compiled = re.compile(self.pattern, self.flags)
        for method in _METHODS:
            self.__dict__[method] = getattr(compiled, method)
        return getattr(compiled, name)

    def __repr__(self) -> str:
        return f"LazyPattern({self.pattern!r})"
