"""Python's garbage collector in the processes we start: fewer collections, and none at exit.

Each of them imports torch (the driver Ray, MLflow and SQLAlchemy too): some 600,000 objects that
live as long as the process. Python's defaults (a young collection every 700 new objects, a full
one each time the objects that survive grow by 25 %) make the imports alone walk all of them
again and again: 9 full collections, 1.1 s of the 7 s of CPU the demo sweep's driver used. And
the interpreter's last collection walks them once more at exit, only to free memory the exit
hands back anyway: 1.2-1.5 s after a command's last line, and 0.5 s in each spawned estimate
process, whose pool waits for its exit (``bench/RESULTS.md``). Only the installed command
(``cli.entry``) and the processes it spawns (``spawned.start``) change the defaults: tests that
call ``cli.main`` in their own process keep them.
"""

from __future__ import annotations

import gc

#: New objects between two young collections (Python's default: 700). At 10,000 the demo
#: driver's start made no full collection; 50,000 did no better. The cycles a sweep leaves
#: behind are still collected, in larger rounds.
YOUNG_THRESHOLD = 10_000


def collect_less() -> None:
    """From now on, a young collection every :data:`YOUNG_THRESHOLD` new objects."""
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def skip_last_collection() -> None:
    """Leave every object alive now out of every later collection, the interpreter's last one
    included: for the end of a process, when nothing it made is left to collect."""
    gc.freeze()
