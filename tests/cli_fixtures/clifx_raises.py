"""A module whose import fails."""

raise RuntimeError("engine set-up failed")
