"""The job's verdict once horovodrun (or srun) has ended: its exit code, and the lines that say why (the failing
rank from the ranks' records, the stop, the time-out, or horovodrun's own account when no rank explains its end).
The codes: hvdtrain/exitcodes.py; which rank failed first: failures.py; what horovodrun printed: console.py."""

from __future__ import annotations

import signal

from hvdtrain import exitcodes
from hvdtrain.job.model import Ssh
from hvdtrain.job.plan import LaunchPlan
from hvdtrain.launch.console import OutputRouter, launcher_account
from hvdtrain.launch.failures import FailureTracker

PREEMPTED = (f"hvdtrain: the job stopped to be resumed: the ranks checkpointed at a step boundary (exit "
             f"{exitcodes.PREEMPTED}); run it again to resume from the checkpoint")


def find_lost_hosts(failures: FailureTracker, plan: LaunchPlan, ssh: Ssh) -> None:
    """Gloo does not say which peer it timed out on: ask ssh which of the job's remote hosts is gone (bounded)."""
    from hvdtrain.doctor.ssh import is_local, local_addresses, unreachable_hosts

    here = local_addresses()
    remote = sorted({h for h in plan.rank_hosts if not is_local(h, here)})
    if remote:
        failures.unreachable = unreachable_hosts(remote, ssh.port, ssh.identity_file)


def doctor_argv(plan: LaunchPlan, ssh: Ssh) -> list[str]:
    """`hvdtrain doctor` on the job's hosts (every host of -H: horovodrun checks them all, ranks or not), as
    horovodrun reaches them."""
    hosts = plan.argv[plan.hosts_at] if plan.hosts_at is not None else \
        ",".join(f"{host}:{plan.rank_hosts.count(host)}" for host in dict.fromkeys(plan.rank_hosts))
    return ["hvdtrain", "doctor", "--hosts", hosts, *(["--ssh-port", str(ssh.port)] if ssh.port else []),
            *(["--ssh-identity-file", ssh.identity_file] if ssh.identity_file else [])]


def exit_code(returncode: int, router: OutputRouter, signum: int | None, timed_out: bool,
               check_hosts: list[str]) -> int:
    """The job's exit code: the failing rank's (the cause's, from the ranks' records; else the first to exit); 128 +
    N when signal N killed it; 75 when, and only when, the ranks stopped to be resumed (FailureTracker.preempted)."""
    if timed_out:
        router.note("hvdtrain: job timed out and was stopped")
        return exitcodes.TIMED_OUT
    if signum is not None:
        code = exitcodes.SIGNALLED + signum
        router.note(f"hvdtrain: the job was stopped by {signal.Signals(signum).name}; exit code {code}")
        return code
    if returncode < 0:
        return exitcodes.SIGNALLED - returncode
    if returncode != 0 and router.failures.preempted():
        router.note(PREEMPTED)
        return exitcodes.PREEMPTED
    failure = router.failures.exit_failure()
    if returncode != 0:
        said = router.launcher.hidden  # horovodrun's own account, when its traceback was kept off the console
        launcher = "srun" if router.srun_labels else "horovodrun"
        for line in router.failures.report(router.logs.dir) or launcher_account(launcher, returncode, said,
                                                                                 check_hosts):
            router.note(line)
    code = returncode
    if returncode != 0 and failure is not None:
        code = failure.code or (exitcodes.SIGNALLED + failure.signum if failure.signum else returncode)
    if code == exitcodes.PREEMPTED:  # 75 says "run it again to resume" (`--requeue` does): not after a failure
        router.note(f"hvdtrain: exit code 1, not {code}: a rank failed, so the job did not just stop to be resumed")
        return 1
    return code
