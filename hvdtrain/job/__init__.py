"""A job, from text to a command: YAML text -> `JobSpec` -> `LaunchPlan(argv, env)`.

- `hosts`: `-H a:4,b:4` and hostfiles parsed into `Host`s (parsers take text, return values).
- `allocation`: inside a Slurm allocation, the hosts and slots Slurm gave the job, from its environment.
- `flags`: the Horovod knobs and the horovodrun flag each maps to.
- `model`: the spec's typed, validated models (pydantic), one per YAML section.
- `load`: YAML text (+ `-o key=value` overrides) -> `JobSpec`, or a `SpecError` naming file:line, value and fix.
- `recipe`: a shipped recipe's `recipe:` and `args:` checked by the recipe's own parser, and read once
  (`settings_of`).
- `plan`: `JobSpec` -> `LaunchPlan`: horovodrun's (or srun's) exact argv and environment. No side effects.

Nothing here starts a process or touches the network.
"""
