"""What the training recipes share: atomic checkpoints, LR scaling/warmup, averaged metrics, datasets, config.

Nothing here imports Horovod or a framework at module level: functions take rank/size/values (or a reduction
function) as arguments, so they are testable in one process.
"""
