"""What the training recipes share: atomic self-verifying checkpoints (checkpoint), LR scaling/warmup/steps (lr),
averaged metrics and summary.json (metrics), bundled/synthetic/shard datasets (datasets), a dataclass config
parsed from argv (config) and a log-friendly progress bar (progress).

Nothing here imports Horovod, and only `progress` imports anything beyond numpy at module level (tqdm; sklearn
is imported when digits are loaded): functions take rank/size/values, or a reduction function, as arguments, so
they are testable in one process.
"""
