"""A job, from text to a command: YAML text -> `JobSpec` -> `LaunchPlan(argv, env)`.

- `hosts`: `-H a:4,b:4` and hostfiles parsed into `Host`s (parsers take text, return values).
- `flags`: the Horovod knobs and the horovodrun flag each maps to.
- `model`: the spec's typed, validated models (pydantic), one per YAML section.
- `load`: YAML text (+ `-o key=value` overrides) -> `JobSpec`, or a `SpecError` naming file:line, value and fix.
- `plan`: `JobSpec` -> `LaunchPlan`: horovodrun's exact argv and environment. No side effects.

Nothing here starts a process or touches the network.
"""
