"""Imports fine, but starts a non-daemon thread: the interpreter cannot exit while it runs."""

import threading
import time

threading.Thread(target=time.sleep, args=(60,), name="clifx-worker").start()


def fn(x):
    return x
