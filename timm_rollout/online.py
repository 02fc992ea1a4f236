"""Hub access that fails fast without network: one short probe per process; without an answer a Hub download
uses only the local cache, the offline flags set only for its duration.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from huggingface_hub import constants, get_session

PROBE_TIMEOUT_S = 3.0


@lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """True when the Hub endpoint answers one HTTP request within a few seconds (no retries; cached per process)."""
    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception:  # DNS, refused, timeout, proxy, TLS: any failure means no usable network
        return False
    return True


@contextmanager
def hub_or_cache() -> Iterator[bool]:
    """Yield True when the Hub is used; without network, offline mode (local cache only) meanwhile instead of
    25-45 s of retries. A user's ``HF_HUB_OFFLINE`` is honoured (yields False)."""
    if constants.HF_HUB_OFFLINE:
        yield False
        return
    if hub_reachable():
        yield True
        return
    modules = [constants, *(m for m in (sys.modules.get("datasets.config"),) if m is not None)]
    saved = [m.HF_HUB_OFFLINE for m in modules]
    for module in modules:
        module.HF_HUB_OFFLINE = True
    try:
        yield False
    finally:
        for module, value in zip(modules, saved, strict=True):
            module.HF_HUB_OFFLINE = value
