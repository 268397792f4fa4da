"""The exit codes of `hvdtrain` and of the recipes beyond 0 (done) and 1 (an unexpected error, with its traceback);
docs/recipes.md (the recipes' 2, 3) and docs/jobs.md (`hvdtrain run`'s 124, 128+N) list them."""

INVALID_INPUT = 2  # bad input (spec, hostfile, CLI, data, a busy run directory), reported before anything starts
DIVERGED = 3  # training went NaN/Inf (hvdtrain.train.divergence)
PREEMPTED = 75  # asked to stop (SIGUSR1, SIGTERM, `hvdtrain run` given SIGUSR1): checkpointed mid-epoch, run again to
#                resume (EX_TEMPFAIL; `hvdtrain run --requeue` requeues the Slurm job: hvdtrain/train/preempt.py)
TIMED_OUT = 124  # hvdtrain run --timeout ran out (as timeout(1))
SIGNALLED = 128  # + the signal's number: the job was stopped by that signal (SIGINT: 130)
