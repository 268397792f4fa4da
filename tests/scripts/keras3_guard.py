"""Drive hvdtrain.tfkeras's Keras-3 guard in a fresh interpreter (TensorFlow reads TF_USE_LEGACY_KERAS once).

    python keras3_guard.py default        # the guard sets TF_USE_LEGACY_KERAS=1 itself: prints "OK <keras>"
    python keras3_guard.py no-set         # the guard is told not to set it: Keras 3 must stop the import
    python keras3_guard.py import-first   # tf.keras used before the guard (Keras 3): too late to select Keras 2

A refused import raises KerasVersionError (uncaught: traceback and exit status 1).
"""

import sys

mode = sys.argv[1]
if mode == "import-first":
    import tensorflow as early_tf  # deliberately before hvdtrain.tfkeras

    early_tf.keras.Model  # noqa: B018  (tf.keras is resolved lazily, on first use: this picks Keras 3)

from hvdtrain import tfkeras  # noqa: E402

tf = tfkeras.import_tensorflow(set_legacy=mode != "no-set")
print(f"OK {tfkeras.keras_info(tf).describe()}", flush=True)
