"""`hvdtrain render k8s|slurm JOB.yaml`: argparse wiring for the renderers (hvdtrain/cli.py adds it with one call).

Prints the manifest or script, or writes it with `--output FILE`. Errors are printed with what to change and exit
with code 2, like the other subcommands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hvdtrain import exitcodes
from hvdtrain.render.common import IMAGE_PYTHON, IMAGE_REMOTE_DIR, IMAGE_SSH_PORT, ClusterOptions, RenderError
from hvdtrain.render.sbatch import SIGNAL_BEFORE_S, signal_before_arg

if TYPE_CHECKING:
    from hvdtrain.render import K8sOptions, SlurmOptions


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOB.yaml", help="job spec (see `hvdtrain schema` and jobs/)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a spec key (value read as YAML), e.g. -o np=16")
    p.add_argument("--output", metavar="FILE", help="write to FILE instead of printing")
    p.add_argument("--name", help="job name (default: the spec's file name), 1-40 of [a-z0-9-]")
    p.add_argument("--remote-dir", metavar="DIR",
                   help=f"the spec's folder on the cluster; its relative paths resolve there (default: k8s "
                        f"{IMAGE_REMOTE_DIR}, the images' jobs/; slurm: the spec's folder here, on a shared "
                        "filesystem)")
    p.add_argument("--python", help=f"interpreter on the cluster when the spec sets none (default: k8s "
                                    f"{IMAGE_PYTHON}; slurm: the spec's, else the one running hvdtrain here)")
    p.add_argument("--nodes", type=int, help="nodes (default: np / slots per node)")
    p.add_argument("--slots-per-node", type=int, metavar="N",
                   help="ranks per node (default: the spec's hosts' slots when equal, else np)")
    p.add_argument("--gpus-per-node", type=int, metavar="N",
                   help="GPUs per node (default: the spec's gpus_per_rank x slots per node; 0: a CPU job)")
    p.add_argument("--controller", choices=("mpi", "gloo"),
                   help="when the spec sets none (default: as `hvdtrain run`, Gloo where Horovod has it)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `render` with its `k8s` and `slurm` targets to hvdtrain's subcommands."""
    render = sub.add_parser("render", help="render a job spec as a Kubeflow MPIJob or an sbatch script")
    targets = render.add_subparsers(dest="target", required=True, metavar="TARGET")

    p = targets.add_parser("k8s", help="Kubeflow MPI Operator MPIJob (kubeflow.org/v2beta1) YAML")
    _common_args(p)
    p.add_argument("--image", help="image built from docker/Dockerfile, as the pods pull it (default: the spec's "
                                   "kubernetes.image, which one of them must give)")
    p.add_argument("--namespace", help="namespace (default: the spec's kubernetes.namespace, else kubectl's current)")
    p.add_argument("--pull-policy", choices=("Always", "IfNotPresent", "Never"),
                   help="default: the spec's kubernetes.pull_policy (IfNotPresent)")
    p.add_argument("--shm-size", help="size of each worker's /dev/shm, e.g. 16Gi (default: the spec's "
                                      "kubernetes.shm_size, auto: what the recipe's loaders need)")
    p.add_argument("--ssh-port", type=int, default=IMAGE_SSH_PORT,
                   help=f"the workers' sshd port when the spec's ssh.port is unset (default {IMAGE_SSH_PORT}, the "
                        "images' sshd)")
    p.set_defaults(func=cmd_render)

    p = targets.add_parser("slurm", help="sbatch script (hvdtrain run: horovodrun over ssh; or srun)")
    _common_args(p)
    p.add_argument("--launcher", choices=("horovodrun", "srun"), default="horovodrun")
    p.add_argument("--time", help="#SBATCH --time, e.g. 02:00:00")
    p.add_argument("--partition", help="#SBATCH --partition")
    p.add_argument("--account", help="#SBATCH --account")
    p.add_argument("--cpus-per-task", type=int, metavar="N", help="#SBATCH --cpus-per-task")
    p.add_argument("--log-file", metavar="PATTERN", help="#SBATCH --output (default NAME-%%j.out)")
    p.add_argument("--srun-mpi", default="pmix", help="srun --mpi plugin for --launcher srun (default pmix)")
    p.add_argument("--signal-before", default=str(SIGNAL_BEFORE_S), metavar="SECONDS",
                   help=f"#SBATCH --signal=B:USR1@SECONDS: this long before the time limit (Slurm may be up to 60 s "
                        f"early) hvdtrain run asks the ranks to checkpoint and stop, exit {exitcodes.PREEMPTED} "
                        f"(default {SIGNAL_BEFORE_S}; 0: no signal)")
    p.add_argument("--no-requeue", dest="requeue", action="store_false",
                   help="leave out #SBATCH --requeue, --open-mode=append and `hvdtrain run --requeue` (default: a "
                        "job that stopped to be resumed is requeued and resumes from its checkpoint)")
    p.set_defaults(func=cmd_render)


def _target_options(args: argparse.Namespace) -> K8sOptions | SlurmOptions:
    from hvdtrain.render import K8sOptions, SlurmOptions

    if args.target == "k8s":
        return K8sOptions(image=args.image, namespace=args.namespace, image_pull_policy=args.pull_policy,
                          shm_size=args.shm_size, ssh_port=args.ssh_port)
    return SlurmOptions(launcher=args.launcher, time=args.time, partition=args.partition, account=args.account,
                        cpus_per_task=args.cpus_per_task, output=args.log_file, srun_mpi=args.srun_mpi,
                        signal_before=signal_before_arg(args.signal_before), requeue=args.requeue)


def cmd_render(args: argparse.Namespace) -> int:
    from hvdtrain.render import default_name, render_file

    cluster = ClusterOptions(
        name=args.name or default_name(args.job), remote_dir=args.remote_dir, python=args.python,
        nodes=args.nodes, slots_per_node=args.slots_per_node, gpus_per_node=args.gpus_per_node,
        controller=args.controller)
    try:
        text = render_file(args.target, args.job, cluster, _target_options(args), args.override)
    except RenderError as exc:
        print(f"hvdtrain render: error: {exc}", file=sys.stderr)
        return exitcodes.INVALID_INPUT
    if args.output:
        Path(args.output).write_text(text)
        print(f"hvdtrain render: wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
