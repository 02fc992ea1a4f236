"""Atomic file writes: write to a temporary file in the same folder, fsync, then rename.

A process killed at any moment leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "new_file_mode", "publish", "write_json", "write_text"]


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Flush ``tmp`` to disk, give it the permissions a new file gets there, and rename it onto ``path`` atomically.

    Writers such as safetensors and ``mkstemp`` create 0600 files; results should be as readable as any other.
    """
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, new_file_mode(Path(tmp).parent))
    os.replace(tmp, path)


def new_file_mode(folder: str | os.PathLike) -> int:
    """The permissions a new file gets in ``folder`` (0666 less the umask), read off a probe file: the process
    umask is never changed, so threads writing meanwhile are unaffected."""
    probe = Path(tempfile.mktemp(dir=folder, prefix=".mode-"))  # a name only: created with O_EXCL below
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    with atomic_path(path) as tmp:
        writer(tmp)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    return _write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented JSON to ``path``."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
