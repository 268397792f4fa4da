"""Running a `LaunchPlan` and watching it to the end.

- `cmd_run`: `hvdtrain run JOB.yaml` (its argparse wiring): spec -> plan -> preflight -> run, or `--dry-run`.
- `preflight`: what this machine must have before a job starts (Horovod and hvdtrain in the ranks' interpreter,
  horovodrun, a free run directory, a Slurm job for `--requeue`); `LaunchError`.
- `runner`: the supervisor: starts horovodrun (argv list, new session), forwards signals, leaves no process
  behind, exits with the job's code.
- `console`: rank-prefixed output and per-rank log files.
- `failures`: which rank failed first and why (from the ranks' records, hvdtrain.records).
- `verdict`: the job's exit code once horovodrun has ended, and the lines that say why.
- `stops`: SIGUSR1 as a request that the ranks checkpoint and stop (exit 75).
- `lifeline`: the guard process that takes the job down when the launcher dies (no orphans).
- `hvdrun`: `hvdtrain-horovodrun`, horovodrun without its build probe.

The ranks' side of the contract (`python -m hvdtrain.rank`, the records they write) lives at the package's top level.
"""
