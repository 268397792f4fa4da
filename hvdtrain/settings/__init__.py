"""Settings defined once for both sides: a typed dataclass <-> argv (parse) and the shipped recipes' settings
(recipes). A shared layer: nothing here imports torch, TensorFlow or Horovod, or any other hvdtrain package."""
