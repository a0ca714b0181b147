"""Importing this module ends the interpreter, as a broken extension module would."""

import os

os._exit(3)
