"""Atomic file writes: write to a temporary file in the same folder, fsync, then rename.

A process killed at any moment leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Flush ``tmp`` to disk, give it the permissions a new file gets there (``mkstemp`` and safetensors make 0600
    files), and rename it onto ``path`` atomically."""
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


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented JSON to ``path``."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


FIGURE_DPI = 100
PALETTE_COLORS = 256


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Render with matplotlib's Agg canvas (no pyplot state) and write a 256-colour palette PNG atomically: Pillow's
    max-coverage quantiser keeps rare colours such as a map's peak, at a quarter of the RGBA bytes (light in git)."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=FIGURE_DPI, bbox_inches="tight", format="png")
    buf.seek(0)
    with Image.open(buf) as rendered:
        image = rendered.convert("RGB").quantize(PALETTE_COLORS, method=Image.Quantize.MAXCOVERAGE)
    with atomic_path(path) as tmp:
        image.save(tmp, format="png", optimize=True, dpi=(FIGURE_DPI, FIGURE_DPI))
    return Path(path)
