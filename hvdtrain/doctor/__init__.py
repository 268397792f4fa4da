"""What a machine or a set of hosts can run, checked before a job starts.

- `probe`: what the interpreter's Horovod was built with (frameworks, controllers), run in a subprocess and cached.
- `ssh`: the ssh argv hvdtrain uses, which hosts are this machine, and ssh failures in words.
- `local`: `hvdtrain doctor` on this machine (one `Check` per fact, with the fix).
- `remote`: `hvdtrain doctor --hosts/--hostfile`: ssh, Python, Horovod and a common network interface per host.

The launcher (hvdtrain.launch) uses `probe` and `ssh`; nothing here imports the launcher.
"""
