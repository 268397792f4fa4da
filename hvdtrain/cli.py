"""hvdtrain launches Horovod data-parallel training jobs from YAML specs, and prepares and checks the datasets they
stream (MDS shards, on disk or in an object store).

main commands:
  run JOB.yaml              launch a job with horovodrun (--dry-run: print the exact command only)
  validate JOB.yaml         check a job spec, its hostfile and its files without launching
  doctor                    check Horovod, frameworks, controllers, MPI and GPUs (--hosts: over ssh too)
  data convert SRC DST      write an image folder or .npz/.npy shards as a (shuffled) MDS dataset
  data verify DATASET       check every shard against its checksum and every sample and label
  data inspect DATASET      describe a dataset: splits, samples, columns, sizes, label spread
  data upload DIR URL       copy a dataset to s3://, gs:// or http(s)://

example:
  hvdtrain data convert ./images ./mds --image-size 64x64 --val-fraction 0.1
  hvdtrain data verify ./mds
  hvdtrain run jobs/quickstart.yaml --dry-run   # from the repository root: the horovodrun command it runs
  hvdtrain run jobs/quickstart.yaml

`hvdtrain COMMAND --help` describes each command; the README and its docs/ pages have the rest.
"""

# Developer notes: this module parses argv, calls one function per command and maps errors to exit codes
# (hvdtrain/exitcodes.py); no logic lives here. The module docstring above is `hvdtrain --help`'s description.

from __future__ import annotations

import argparse
import functools
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hvdtrain import __version__, exitcodes
from hvdtrain.data.errors import DataError

if TYPE_CHECKING:
    from hvdtrain.job.model import JobSpec

REQUIRABLE = ("mpi", "nccl", "tensorflow")


def _require_list(text: str) -> set[str]:
    items = {s.strip() for s in text.split(",") if s.strip()}
    bad = sorted(items - set(REQUIRABLE))
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown requirement(s) {', '.join(bad)}; allowed: {', '.join(REQUIRABLE)} (comma-separated)")
    return items


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535)")
    return int(text)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from hvdtrain.doctor.local import doctor

    more = None
    if args.hosts is None and args.hostfile is None and (args.ssh_port or args.ssh_identity_file):
        print("hvdtrain doctor: error: --ssh-port/--ssh-identity-file need --hosts or --hostfile (the hosts to "
              "check over ssh)", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    if args.hosts is not None or args.hostfile is not None:
        from hvdtrain.doctor.remote import host_checks, load_hosts

        hosts = load_hosts(args.hosts, args.hostfile)  # HostError: exit 2 with the parser's message
        more = functools.partial(host_checks, hosts, port=args.ssh_port, identity_file=args.ssh_identity_file)
    return doctor(args.require, as_json=args.json, more=more)


def _load(args: argparse.Namespace) -> JobSpec:
    from hvdtrain.job.load import load_spec_file

    return load_spec_file(args.job, args.override, check_files=True)


def _cmd_validate(args: argparse.Namespace) -> int:
    from hvdtrain.job.plan import build_plan

    spec = _load(args)
    # The same pure build `run --dry-run` does, so that validate accepts only what dry-run accepts; only what this
    # machine decides (the controller Horovod was built with, where horovodrun is) is left to `run`.
    build_plan(spec, controller=spec.controller or "gloo")
    where = "elastic (discovery script)" if spec.elastic else spec.hosts
    print(f"{args.job}: OK — np={spec.np}, hosts={where}, controller={spec.controller or 'auto'}, "
          f"script={spec.script}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    import json

    from hvdtrain.job.model import JobSpec

    print(json.dumps(JobSpec.model_json_schema(), indent=2))
    return 0


def _convert_arg(name: str) -> Callable[[str], Any]:
    """An argparse `type` calling hvdtrain.stream.convert's parser `name` (imported when used: numpy is slow to
    import); its ValueError becomes argparse's error, exit 2."""

    def parse(text: str) -> Any:
        from hvdtrain.stream import convert

        try:
            return getattr(convert, name)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1), e.g. 0.1")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (an integer >= 0, e.g. 8)")
    return int(text)


def _cmd_data_convert(args: argparse.Namespace) -> int:
    from hvdtrain.stream.convert import convert

    try:
        summary = convert(args.src, args.dst, shard_bytes=args.shard_size, compression=args.compression,
                          image_size=args.image_size, val_fraction=args.val_fraction, progress=args.progress,
                          shuffle=args.shuffle, seed=args.seed, encoded=args.encoded, skip_bad=args.skip_bad)
    except DataError as exc:
        print(f"hvdtrain data convert: error: {exc}", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    except OSError as exc:  # DST not writable, a file where a directory must be, a full disk
        print(f"hvdtrain data convert: error: {exc.strerror or exc}: {exc.filename or args.dst} (nothing that "
              "looks complete was written: the index is written last)", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    print(summary.render())
    return 0


def _cmd_data_inspect(args: argparse.Namespace) -> int:
    import json

    from hvdtrain.stream.inspect import describe, render, warnings

    try:
        desc = describe(args.path, label_field=args.y_field, label_shards=args.label_shards)
    except DataError as exc:
        print(f"hvdtrain data inspect: error: {exc}", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    print(json.dumps(desc, indent=2) if args.json else render(desc))
    for warning in warnings(desc):
        print(f"hvdtrain data inspect: warning: {warning}", file=sys.stderr)
    return 0


def _cmd_data_verify(args: argparse.Namespace) -> int:
    import json

    from hvdtrain.stream.verify import messages, verdict, verify_dataset

    results = []
    try:
        for result in verify_dataset(args.dataset, args.split, args.y_field):
            results.append(result)
            if not args.json:
                print(result.render(), flush=True)
            for line in messages(result):
                print(f"hvdtrain data verify: {line}", file=sys.stderr, flush=True)
    except DataError as exc:
        print(f"hvdtrain data verify: error: {exc}", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    ok, closing = verdict(args.dataset, results)
    if args.json:
        print(json.dumps({"path": args.dataset, "ok": ok, "splits": {r.name: r.as_dict() for r in results}},
                         indent=2))
    print(closing, file=sys.stdout if ok and not args.json else sys.stderr)
    return 0 if ok else exitcodes.INVALID_INPUT


def _cmd_data_upload(args: argparse.Namespace) -> int:
    from hvdtrain.stream.upload import render, upload

    try:
        result = upload(args.src, args.url, progress=args.progress)
    except DataError as exc:
        print(f"hvdtrain data upload: error: {exc}", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    except OSError as exc:
        print(f"hvdtrain data upload: error: {exc.strerror or exc}: {exc.filename or args.src}", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    print(render(result))
    return 0


def _add_data_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pathlib import Path

    data = sub.add_parser("data", help="convert, verify, inspect and upload datasets of MDS shards (streamed "
                          "training)")
    cmds = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    p = cmds.add_parser("convert", help="write an array shard directory or an image folder as an MDS dataset",
                        description="Write SRC as an MDS dataset in DST (train/ and val/, one index.json each); "
                                    "see hvdtrain/stream/convert.py for the layouts read.")
    p.add_argument("src", type=Path, metavar="SRC", help="*.npz / NAME_x.npy+NAME_y.npy shards, or CLASS/**/*.jpg|png "
                   "images (any depth below each class directory); with train/ and val/ subdirectories those are "
                   "the splits")
    p.add_argument("dst", type=Path, metavar="DST", help="new (or empty) directory; gets train/ and val/")
    p.add_argument("--shard-size", type=_convert_arg("parse_size"), default="64MiB", metavar="SIZE",
                   help="bytes per shard before compression, e.g. 64MiB (default), 1GB, 1000000")
    p.add_argument("--compression", type=_convert_arg("parse_compression"), default=None, metavar="zstd[:LEVEL]",
                   help="compress shards with zstd (LEVEL 1..22, default 3); readers decompress them once per "
                        "node; default: none")
    p.add_argument("--image-size", type=_convert_arg("parse_image_size"), default=None, metavar="HxW",
                   help="resize every image to this (default: all images must have one size)")
    p.add_argument("--encoded", action="store_true",
                   help="images: keep each JPEG/PNG file as it is (a jpeg column, any sizes; typically 5-10x smaller "
                        "than pixels), decoded and augmented per batch by the loader's producers at the training's "
                        "--image-size (default there: the first training image's shorter side, at most 224 px; "
                        "on a CPU pass e.g. --image-size 64); default: decoded pixels")
    p.add_argument("--skip-bad", action="store_true",
                   help="images: leave out files that do not decode, counted in the summary and recorded in the "
                        "index (default: list every bad file and write nothing)")
    p.add_argument("--val-fraction", type=_fraction, default=0.0, metavar="F",
                   help="for a SRC without train/ and val/: hold out this fraction, evenly spaced, as val/")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the shuffle each split is written in (default 0: the same input gives the same bytes)")
    p.add_argument("--keep-order", dest="shuffle", action="store_false",
                   help="write samples in the source's order instead of shuffled (a class-sorted source then needs "
                        "a shuffle block spanning every class to train)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=_cmd_data_convert)

    p = cmds.add_parser("inspect", help="describe an MDS dataset (splits, samples, shards, columns, sizes, "
                        "label spread)", description="Describe an MDS dataset from its index.json files, and how "
                        "its labels spread over a few of its shards (warning when a split looks sorted by class).")
    p.add_argument("path", metavar="PATH", help="a dataset root (train/, val/) or one MDS directory, or its "
                   "s3:// gs:// http(s):// URL")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.add_argument("--y-field", default="y", metavar="NAME", help="the labels column (default y)")
    p.add_argument("--label-shards", type=_count, default=8, metavar="N",
                   help="read the labels of at most N shards per split, evenly spaced (default 8; 0: none). Local "
                        "raw shards: only the labels column; others are fetched whole, none more once 256 MiB of "
                        "a split were")
    p.set_defaults(func=_cmd_data_inspect)

    p = cmds.add_parser("verify", help="check every shard against its checksum, decode every sample, check labels",
                        description="Check every shard of every split of DATASET against the index's checksum "
                                    "(its fastest hash), decode every sample, check that array columns keep one "
                                    "shape and that labels are integer class ids, and report how the labels spread "
                                    "over the shards. Exit 0: OK; 2: a problem, each named with its fix. Writes "
                                    "nothing.")
    p.add_argument("dataset", metavar="DATASET", help="a dataset root (train/, val/) or one MDS directory, or its "
                   "s3:// gs:// http(s):// URL")
    p.add_argument("--split", action="append", default=None, metavar="NAME",
                   help="verify only this split (repeat for several; default: all)")
    p.add_argument("--y-field", default="y", metavar="NAME", help="the labels column (default y)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_cmd_data_verify)

    p = cmds.add_parser("upload", help="copy an MDS dataset to an object store (s3://, gs://, http(s)://)",
                        description="Put every file of the MDS dataset SRC under URL, each split's index.json last. "
                                    "S3 reads the AWS_* environment variables (AWS_ENDPOINT_URL for MinIO, moto...).")
    p.add_argument("src", type=Path, metavar="SRC", help="a dataset root (train/, val/) or one MDS directory")
    p.add_argument("url", metavar="URL", help="s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or http(s)://HOST/PREFIX")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=_cmd_data_upload)


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOB.yaml", help="job spec (see `hvdtrain schema` and jobs/)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a spec key (value read as YAML), e.g. -o np=4 -o horovod.cycle_time_ms=2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hvdtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("doctor", help="check Horovod, frameworks, controllers, MPI and GPUs")
    p.add_argument("--require", type=_require_list, default=set(), metavar="LIST",
                   help=f"also require these (comma-separated): {', '.join(REQUIRABLE)}")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="H:N,...", help="also check these hosts over ssh (e.g. a:4,b:4)")
    where.add_argument("--hostfile", metavar="FILE", help="also check the hosts of this hostfile over ssh")
    p.add_argument("--ssh-port", type=_port, default=None, metavar="PORT", help="ssh port on every host")
    p.add_argument("--ssh-identity-file", default=None, metavar="KEY", help="private key for ssh")
    p.set_defaults(func=_cmd_doctor)

    from hvdtrain.launch.cmd_run import add_parser as add_run_parser

    add_run_parser(sub, _add_job_args)

    p = sub.add_parser("validate", help="check a job spec, its hostfile and its files without launching")
    _add_job_args(p)
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("schema", help="print the JSON Schema of job specs")
    p.set_defaults(func=_cmd_schema)

    from hvdtrain.render.cmd_render import add_parser as add_render_parser

    add_render_parser(sub)
    _add_data_parser(sub)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM while a `data` command writes: unwinds like Ctrl-C, so what it wrote is removed."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    command = argv[0] if argv else (sys.argv[1] if len(sys.argv) > 1 else "")
    if command == "data":  # `run` handles SIGTERM itself once a job starts (NOTE [job shutdown] in launch/runner.py)
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv)
    except KeyboardInterrupt as e:  # Ctrl-C before a job started (then run_plan handles it: NOTE [job shutdown])
        signum = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
        what = "nothing was written that looks complete" if command == "data" else "no job was started"
        print(f"hvdtrain: interrupted ({signum.name}); {what}", file=sys.stderr)
        return exitcodes.SIGNALLED + signum
    except BrokenPipeError:  # `hvdtrain ... | head`: the reader left; say nothing more, as other tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush fails quietly
        return exitcodes.SIGNALLED + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits with 2 on bad usage
    from hvdtrain.job.hosts import HostError
    from hvdtrain.job.load import SpecError
    from hvdtrain.launch.preflight import LaunchError

    func: Callable[[argparse.Namespace], int] = args.func  # set_defaults(func=...) of each subcommand
    try:
        return func(args)
    except (SpecError, HostError) as exc:
        print(exc, file=sys.stderr)
        return exitcodes.INVALID_INPUT
    except LaunchError as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr)
        return exitcodes.INVALID_INPUT


if __name__ == "__main__":
    sys.exit(main())
