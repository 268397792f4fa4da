"""hvdtrain: a Horovod distributed-training launcher with data-parallel loaders."""

__version__ = "0.9.0"
