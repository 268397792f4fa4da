"""Running a `LaunchPlan` and watching it to the end.

- `runner`: starts horovodrun (argv list, new session), forwards signals, exits with the job's code.
- `console`: rank-prefixed output and per-rank log files.
- `failures`: which rank failed first and why (from the ranks' records, hvdtrain.records), the verdict.
- `lifeline`: the guard process that takes the job down when the launcher dies (no orphans).

The ranks' side of the contract (`python -m hvdtrain.rank`, the records they write) lives at the package's top level.
"""
