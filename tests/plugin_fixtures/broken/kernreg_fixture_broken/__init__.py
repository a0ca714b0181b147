"""A plugin that fails: every module leaves a marker file when imported (FIXTURE_MARKER_DIR)."""

import os


def leave_marker(name):
    directory = os.environ.get("FIXTURE_MARKER_DIR")
    if directory:
        with open(os.path.join(directory, name), "w") as handle:
            handle.write("imported\n")


def kernel(x):
    return x
