"""hvdtrain: a Horovod distributed-training launcher with data-parallel loaders."""

import time as _time

__version__ = "0.9.0"
IMPORTED_AT = _time.time()  # when this process first imported hvdtrain (records.launcher_started)
