"""The collector after startup: what a server process built to start (its imports, the
tokenizer, the model) lives until it exits, so the cyclic collector need not walk it.

A full collection walks every tracked object: in the router, with transformers and the
tokenizer loaded, some 300,000, which stalls its event loop for about 0.2 s on a 2-core
CPU. Python runs one whenever the objects that survived the younger generations grow by
a quarter, so under load it would land in the middle of streams (a late token for every
one of them, a deadline missed). `freeze_startup_heap` moves that startup heap out of
the collector's sight (`gc.freeze`, what vLLM does after its startup too): later
collections walk only what serving allocated.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("textgate")


def freeze_startup_heap() -> int:
    """Collect once, then keep every object left out of later collections. Returns how
    many objects the collector will no longer walk."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("Startup heap frozen: %d objects out of the collector's walks", frozen)
    return frozen
