"""One collector setting for the long-lived processes that hold many objects and make many more:
trainer rank 0 (the driver) and the operator (docs/design.md#at-scale)."""

from __future__ import annotations

import gc


def settle_gc(thresholds: tuple[int, int, int]) -> None:
    """Move everything made so far (the imports, the model) into the permanent generation, so a
    full collection walks only what the process makes from now on, and collect at `thresholds`
    (Python's are 700, 10, 10): at the defaults, full collections of a large live heap took a
    third or more of these processes' CPU."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
