"""What the training recipes share that is not Horovod.

- `recipe_data`: a recipe's `--dataset` opened as train/val splits; `streamed`: an MDS root for the recipes.
- `checkpoint`: atomic, self-verifying checkpoints; `lr`: LR scaling, warmup and steps; `metrics`: metrics averaged
  across ranks and summary.json; `report`: what every recipe prints and records.
- `precision`: mixed precision, `--channels-last`, `--compile`; `channels_last`: Keras's N×H×W×C batches, made in
  the producers; `divergence`: NaN/Inf stops; `stepflags`: a step's flags read a step late.
- `preempt`: stop requests (checkpoint at a step boundary, exit 75); `kerasstop`: the Keras recipe's.
- `startup`: the time to the first step, and its parts; `progress`: a log-friendly progress bar; `entry`: a
  recipe's exit codes.
- `torchkit`, `keraskit`: the PyTorch and Keras training loops' helpers.

The recipes' settings are hvdtrain/settings/. Nothing here calls Horovod (report only reads its version):
functions take rank/size/values, or a reduction function, as arguments, so they are testable in one process.
"""
