"""``python -m timm_rollout.train`` and ``torchrun -m timm_rollout.train``: one-line errors, exit code 2; ``--help``
and argument errors come before the training modules (and timm) load."""

from ..cli import run_cli
from .flags import build_parser


def _main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)  # errors before the training modules load; parsed once
    from .loop import train_parsed

    train_parsed(args, parser)


if __name__ == "__main__":
    run_cli(_main)
