"""The one error base for data at fault: formats (hvdtrain.datasets) and streaming (hvdtrain.stream) extend it."""


class DataError(ValueError):
    """The data or where it is stored is at fault, not the code: unreadable, invalid, missing or unreachable.

    A producer that raises one reports its message as the data's fault (`WorkerFailed.bad_data`), and the recipes
    exit with one line naming it instead of a traceback."""
