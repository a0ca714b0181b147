"""Importing this module hangs."""

import time

time.sleep(60)


def fn(x):
    return x
