"""heap.py: after startup, a server's heap is out of the cyclic collector's walks.

In a child process: freezing the pytest process's own heap would keep its cyclic garbage
from ever being collected."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from textgate.heap import freeze_startup_heap

startup = [[i] for i in range(200_000)]  # what a server built to start: tracked lists
garbage = []
garbage.append(garbage)  # a cycle no one holds: collected, not frozen
del garbage
walked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
walked_after = len(gc.get_objects())
served = [[i] for i in range(1_000)]  # what serving allocates stays collectable
print(frozen, walked_before, walked_after, len(gc.get_objects()) - walked_after)
"""


def test_the_startup_heap_leaves_the_collectors_walks_and_serving_stays_in_them() -> None:
    done = subprocess.run(
        [sys.executable, "-P", "-c", CHILD], capture_output=True, text=True, check=True
    )
    frozen, walked_before, walked_after, served = map(int, done.stdout.split())
    assert frozen >= 200_000
    assert walked_before >= 200_000 > 100 * walked_after
    assert served >= 1_000
