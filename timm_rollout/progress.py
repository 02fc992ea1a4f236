"""Progress bars that draw only on a terminal: a log file gets each command's one-line summary, not bars."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm


def progress(iterable: Iterable | None = None, *, disable: bool = False, **kwargs: Any) -> tqdm:
    """``tqdm(iterable, **kwargs)``, off when asked (``disable``) and whenever stderr is not a terminal."""
    return tqdm(iterable, disable=True if disable else None, **kwargs)  # None: tqdm's own "off unless a TTY"
