"""Moved to :mod:`kernreg.torch.distributed` (it imports torch); this name goes in the next
release."""

import warnings

from kernreg.torch.distributed import *  # noqa: F403
from kernreg.torch.distributed import __all__  # noqa: F401

warnings.warn(
    "kernreg.distributed moved to kernreg.torch.distributed (this name goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
