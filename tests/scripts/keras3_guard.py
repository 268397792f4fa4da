"""Drive hvdtrain.tfkeras's Keras check in a fresh interpreter (TensorFlow reads TF_USE_LEGACY_KERAS once, at import).

    python keras3_guard.py default        # nothing sets TF_USE_LEGACY_KERAS: Keras 3, accepted: prints "OK <keras>"
    python keras3_guard.py legacy         # TF_USE_LEGACY_KERAS=1 before TensorFlow is imported: "OK tf_keras ..."
    python keras3_guard.py import-first   # TensorFlow imported before it is set to 1: asked for tf_keras, got Keras 3

A refused import raises KerasVersionError (uncaught: traceback and exit status 1).
"""

import os
import sys

mode = sys.argv[1]
if mode == "import-first":
    import tensorflow as early_tf  # deliberately before TF_USE_LEGACY_KERAS is set

    early_tf.keras.Model  # noqa: B018  (resolves tf.keras: Keras 3, as the variable was unset at import)
if mode != "default":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # as a job's environment would, before anything imports TensorFlow

from hvdtrain import tfkeras  # noqa: E402

tf = tfkeras.import_tensorflow()
print(f"OK {tfkeras.keras_info(tf).describe()}", flush=True)
