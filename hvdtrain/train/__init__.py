"""What the training recipes share that is not Horovod: `--dataset` opened as train/val splits (datasets, streamed),
atomic self-verifying checkpoints (checkpoint), LR scaling/warmup/steps (lr), averaged metrics and summary.json
(metrics, report) (the recipes' settings: hvdtrain/settings/), mixed precision (precision), NaN/Inf stops
(divergence), a recipe's exit codes (entry), a log-friendly progress bar (progress), and the PyTorch and Keras
training loops' helpers (torchkit, keraskit; layout makes Keras's N×H×W×C batches in the producers).

Nothing here calls Horovod (report only reads its version): functions take rank/size/values, or a reduction
function, as arguments, so they are testable in one process.
"""
