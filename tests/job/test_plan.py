"""build_plan is pure: spec in, exact horovodrun argv + env out. Every knob's flag is pinned here."""

from __future__ import annotations

import pytest

from hvdtrain.job.load import SpecError, load_spec
from hvdtrain.job.plan import MPI_REMOTE_ENV, LaunchPlan, build_plan

PY = "/venv/bin/python"


def plan_for(text: str, controller: str = "gloo", **kwargs) -> LaunchPlan:
    spec = load_spec(f"python: {PY}\n" + text, "/jobs/job.yaml", **kwargs)
    return build_plan(spec, controller=controller, horovodrun="horovodrun")


def test_minimal_plan():
    plan = plan_for("script: train.py\nnp: 2\n")
    assert plan.argv == ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", PY, "-m", "hvdtrain.rank",
                         "/jobs/train.py"]
    assert plan.env == {}


def test_every_modeled_key_maps_to_its_flag_in_order():
    text = """
script: train.py
args: [--lr, 0.1, "$(touch /tmp/x)", "a b"]
np: 4
hosts: a:2,b:2
env: {OMP_NUM_THREADS: 1, X: "$(id)"}
ssh: {port: 2222, identity_file: keys/id}
network_interfaces: [eth0, ib0]
horovod:
  fusion_threshold_mb: 0
  cycle_time_ms: 2.5
  cache_capacity: 2048
  autotune: true
  autotune_log_file: at.csv
  timeline_file: tl.json
  timeline_mark_cycles: false
  stall_check: false
  stall_check_warning_s: 30
  stall_check_shutdown_s: 60
  log_level: DEBUG
  gloo_timeout_s: 90
  start_timeout_s: 45
  num_nccl_streams: 2
  hierarchical_allreduce: true
  hierarchical_allgather: false
  tcp_only: true
  verbose: true
extra_args: [--disable-cache]
"""
    plan = plan_for(text, controller="mpi")
    assert plan.argv == [
        "horovodrun", "-np", "4", "-H", "a:2,b:2", "--mpi", "--network-interfaces", "eth0,ib0",
        "--ssh-port", "2222", "--ssh-identity-file", "/jobs/keys/id",
        "--fusion-threshold-mb", "0", "--cycle-time-ms", "2.5", "--cache-capacity", "2048",
        "--hierarchical-allreduce", "--no-hierarchical-allgather", "--autotune", "--autotune-log-file",
        "/jobs/at.csv", "--timeline-filename", "/jobs/tl.json", "--no-timeline-mark-cycles", "--no-stall-check",
        "--stall-check-warning-time-seconds", "30", "--stall-check-shutdown-time-seconds", "60",
        "--log-level", "DEBUG", "--gloo-timeout-seconds", "90", "--start-timeout", "45", "--num-nccl-streams", "2",
        "--tcp", "--verbose", "--disable-cache",
        PY, "-m", "hvdtrain.rank", "/jobs/train.py", "--lr", "0.1", "$(touch /tmp/x)", "a b",
    ]
    assert plan.env == {"OMP_NUM_THREADS": "1", "X": "$(id)", **MPI_REMOTE_ENV}  # MPI with remote hosts
    assert plan.rank_hosts == ("a", "a", "b", "b")


@pytest.mark.parametrize(("hosts", "controller", "keepalive"), [
    ("a:1,b:1", "mpi", True), ("localhost:2", "mpi", False), ("127.0.0.1:2", "mpi", False),
    ("a:1,b:1", "gloo", False)])
def test_mpi_jobs_with_remote_hosts_get_oob_keepalive_unless_the_spec_sets_it(hosts, controller, keepalive):
    plan = plan_for(f"script: t.py\nnp: 2\nhosts: '{hosts}'\n", controller=controller)
    assert plan.env == (MPI_REMOTE_ENV if keepalive else {})
    mine = plan_for(f"script: t.py\nnp: 2\nhosts: '{hosts}'\nenv: {{OMPI_MCA_oob_tcp_keepalive_time: '3'}}\n",
                    controller=controller)
    assert mine.env["OMPI_MCA_oob_tcp_keepalive_time"] == "3"


def test_elastic_plan_uses_discovery_not_hosts_and_defaults_min_max_to_np():
    plan = plan_for("script: t.py\nnp: 2\nelastic: {discovery_script: d.sh}\n")
    assert plan.argv == ["horovodrun", "-np", "2", "--gloo", "--host-discovery-script", "/jobs/d.sh",
                         "--min-np", "2", "--max-np", "2", PY, "-m", "hvdtrain.rank", "/jobs/t.py"]
    plan = plan_for("script: t.py\nnp: 2\nelastic: {discovery_script: d.sh, min_np: 1, max_np: 8, "
                    "slots_per_host: 4, reset_limit: 0, timeout_s: 60, blacklist_cooldown_s: [10, 300]}\n")
    assert plan.argv[4:-4] == ["--host-discovery-script", "/jobs/d.sh", "--min-np", "1", "--max-np", "8",
                               "--slots-per-host", "4", "--reset-limit", "0", "--elastic-timeout", "60",
                               "--blacklist-cooldown-range", "10", "300"]


def test_describe_quotes_for_display_only():
    plan = plan_for("script: t.py\nnp: 1\nargs: [\"$(id)\", a b]\nenv: {B: 'x y', A: '1'}\n")
    assert plan.argv[-2:] == ["$(id)", "a b"]  # the argv itself is never quoted or joined
    assert plan.describe() == (
        "# command\n"
        f"horovodrun -np 1 -H localhost:1 --gloo {PY} -m hvdtrain.rank /jobs/t.py '$(id)' 'a b'\n"
        "# environment added (forwarded to every rank)\n"
        "A=1\nB='x y'")
    assert plan_for("script: t.py\nnp: 1\n").describe().endswith("# environment added (forwarded to every rank)"
                                                                    "\n(none)")


def test_workdir_resolves_against_the_spec_folder_and_is_the_plans_cwd():
    plan = plan_for("script: t.py\nnp: 1\nworkdir: ../data\n")
    assert plan.cwd == "/data"
    assert plan.describe().startswith("# working directory\n/data\n# command\n")
    assert plan_for("script: t.py\nnp: 1\n").cwd is None
    # horovodrun's Gloo launcher cds there on remote hosts through a shell, unquoted.
    with pytest.raises(SpecError, match=r"workdir: .*passes this path to a shell unquoted"):
        plan_for("script: t.py\nnp: 1\nworkdir: 'data dir'\n")


def test_controller_must_be_known():
    spec = load_spec("script: t.py\nnp: 1\n", "/jobs/job.yaml")
    with pytest.raises(ValueError, match="controller must be one of"):
        build_plan(spec, controller="tcp")
