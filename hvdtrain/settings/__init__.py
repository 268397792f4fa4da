"""Settings defined once for both sides. A shared layer: nothing here imports torch, TensorFlow or Horovod, or any
other hvdtrain package.

- `parse`: a typed dataclass <-> argv: the recipes' own parser, and the same parser checking a spec's recipe
  arguments before launch (`check_args`).
- `recipes`: each shipped recipe's settings (`PytorchTrainConfig`, `PytorchElasticConfig`, `KerasTrainConfig`).
- `loader`: ShmLoader's sizes (prefetch, a slot's first segment), which `render k8s` sizes /dev/shm from.
"""
