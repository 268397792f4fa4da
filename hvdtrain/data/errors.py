"""The data package's errors: DataError, the one error base for data at fault (the formats in hvdtrain.formats
and streaming, hvdtrain.stream, extend it), and the loader's: LoaderError, and WorkerError, WorkerDiedError and
LoaderTimeoutError derived from it (a producer raised, died or went silent), and SharedMemoryFullError (/dev/shm
cannot hold the batches)."""


class DataError(ValueError):
    """The data or where it is stored is at fault, not the code: unreadable, invalid, missing or unreachable.

    A producer that raises one reports its message as the data's fault (`WorkerFailed.bad_data`), and the recipes
    exit with one line naming it instead of a traceback."""


class SamplerMismatch(ValueError):
    """A saved sampler state of other data: another number of samples, seed, shuffle or order."""


class LoaderError(RuntimeError):
    """The data loader cannot go on (its message says which worker, rank and epoch)."""


class WorkerError(LoaderError):
    """User code raised in a producer process; the message carries the original traceback, `message` the original
    exception's text, `bad_data` whether it was a DataError (unreadable or invalid data, named in `message`)."""

    def __init__(self, text: str, *, message: str = "", bad_data: bool = False) -> None:
        super().__init__(text)
        self.message, self.bad_data = message, bad_data


class WorkerDiedError(LoaderError):
    """A producer process exited without being asked to (killed, segfault, os._exit)."""


class LoaderTimeoutError(LoaderError, TimeoutError):
    """A producer did not answer within `timeout` seconds: no batch although every worker is alive, or its
    start-up data unread."""


class SharedMemoryFullError(LoaderError):
    """/dev/shm has no room for a batch segment (a container's default is 64 MiB): the message says how big it is,
    what the loader needs and how to give it more. Raised before any producer writes (NOTE [shm reservation] in
    shm.py): never a SIGBUS."""
