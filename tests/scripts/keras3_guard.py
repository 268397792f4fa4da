"""Drive hvdtrain.tfkeras's Keras-3 guard in a fresh interpreter (TensorFlow reads TF_USE_LEGACY_KERAS once).

    python keras3_guard.py default        # this entry point sets TF_USE_LEGACY_KERAS=1 first: prints "OK <keras>"
    python keras3_guard.py no-set         # nothing sets it (the guard never does): Keras 3 must stop the import
    python keras3_guard.py import-first   # TensorFlow imported before it is set (Keras 3): too late for Keras 2

A refused import raises KerasVersionError (uncaught: traceback and exit status 1).
"""

import os
import sys

mode = sys.argv[1]
if mode == "import-first":
    import tensorflow as early_tf  # deliberately before TF_USE_LEGACY_KERAS is set

    early_tf.keras.Model  # noqa: B018  (resolves tf.keras: Keras 3, as the variable was unset at import)
if mode != "no-set":
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # as recipes/keras_train.py's main() does

from hvdtrain import tfkeras  # noqa: E402

tf = tfkeras.import_tensorflow()
print(f"OK {tfkeras.keras_info(tf).describe()}", flush=True)
