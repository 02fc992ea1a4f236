"""Share a training output folder on the Hugging Face Hub: model.safetensors, config.json and a model card.

    python scripts/push_to_hub.py runs/c10-rollout --repo-id org/vit-tiny-cifar10-rollout --eval eval/c10-rollout
    python scripts/push_to_hub.py runs/c10-rollout --repo-id org/vit-tiny-cifar10-rollout --dry-run --output hub/

What goes into the card, and loading it back: scripts/README.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import timm_rollout  # noqa: F401  (registers the architectures with timm)
from harness.hub import upload_folder, write_upload_folder
from timm_rollout.cli import CliParser, output_dir, run_cli
from timm_rollout.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = CliParser(prog="python scripts/push_to_hub.py", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="training output folder (model.safetensors + config.json + train_args.json)")
    p.add_argument("--repo-id", required=True, help="Hub repository, e.g. org/vit-tiny-cifar10-rollout")
    p.add_argument("--eval", metavar="DIR", help="harness output folder whose results.json goes into the card")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--dry-run", action="store_true", help="write the upload folder to --output, upload nothing")
    p.add_argument("--output", metavar="DIR", type=output_dir,
                   help="where to write the upload folder (required with --dry-run)")
    p.add_argument("--commit-message", default="", help="default: 'Upload <architecture> from <run>'")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run and not args.output:
        raise UserError("--dry-run needs --output DIR to write the upload folder into")
    run = Path(args.run)
    with tempfile.TemporaryDirectory(prefix="hub-upload-") as tmp:
        folder = Path(args.output or tmp)
        files, architecture = write_upload_folder(run, folder, args.repo_id, args.eval)
        listing = ", ".join(f"{f.name} ({f.stat().st_size / 1e6:.2f} MB)" for f in files)
        if args.dry_run:
            print(f"dry run: wrote {listing} to {folder}; nothing uploaded")
            return
        message = args.commit_message or f"Upload {architecture} from {run.name}"
        url = upload_folder(folder, args.repo_id, private=args.private, commit_message=message)
    print(f"uploaded {listing} to {url}{' (private)' if args.private else ''}")


if __name__ == "__main__":
    run_cli(main)
