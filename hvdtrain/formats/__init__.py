"""Dataset formats and splits, below both the loaders' users (hvdtrain.train) and streaming (hvdtrain.stream).

- `arrays`: in-memory datasets, train/val `Splits`, the bundled digits and synthetic data, and the label and
  sample checks every format shares; `DatasetError`.
- `npyfiles`: reading `.npy`/`.npz` shards safely (headers checked against file sizes, memory-mapped arrays).
- `npyshards`: a directory of `.npy`/`.npz` shards as memory-mapped splits.
- `cachedir`: the per-node cache directory (a file is produced once per node, atomically).
- `openfiles`: how many files a process keeps mapped.

Nothing here imports Horovod, torch or TensorFlow.
"""
