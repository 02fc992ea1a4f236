"""Progress bars that draw only on a terminal (a log file gets each command's one-line summary, not bars), and the
wall time of a command's stages."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm


def progress(iterable: Iterable | None = None, *, disable: bool = False, **kwargs: Any) -> tqdm:
    """``tqdm(iterable, **kwargs)``, off when asked (``disable``) and whenever stderr is not a terminal."""
    return tqdm(iterable, disable=True if disable else None, **kwargs)  # None: tqdm's own "off unless a TTY"


class Stopwatch:
    """Wall time of named stages, in seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 3)
