"""`hvdtrain` command line: parse argv, call one function, map errors to exit codes. No logic lives here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hvdtrain import __version__

EXIT_INVALID_INPUT = 2
REQUIRABLE = ("mpi", "nccl", "tensorflow")


def _require_list(text: str) -> set[str]:
    items = {s.strip() for s in text.split(",") if s.strip()}
    bad = sorted(items - set(REQUIRABLE))
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown requirement(s) {', '.join(bad)}; allowed: {', '.join(REQUIRABLE)} (comma-separated)")
    return items


def _cmd_doctor(args: argparse.Namespace) -> int:
    from hvdtrain.doctor import doctor

    return doctor(args.require, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hvdtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("doctor", help="check Horovod, frameworks, controllers, MPI and GPUs")
    p.add_argument("--require", type=_require_list, default=set(), metavar="LIST",
                   help=f"also require these (comma-separated): {', '.join(REQUIRABLE)}")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits with 2 on bad usage
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
