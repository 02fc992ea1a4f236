"""User-facing errors and the CLI wrapper that turns them into one-line messages."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(ValueError):
    """A mistake in the user's input (bad flag, missing column, mismatched checkpoint...).

    The message is one line that names the fix; CLIs print it without a traceback and exit 2.
    """


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run ``main(argv)``; a :class:`UserError` prints one line and exits 2."""
    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted; finished work is kept on disk", file=sys.stderr)
        raise SystemExit(130) from None
