"""The typed failures an executor reports to whoever drives it (the engine, its supervisor, the views): plain
exceptions, torch-free, so that every layer above the executors decides on them by type."""


class WorkerError(RuntimeError):
    """A worker died or failed; the message names its rank."""


class WorkerDied(WorkerError):
    """A worker's process or actor is gone (killed, crashed, exited): what every executor raises when it finds one
    dead, so that callers tell a death from a late answer or a failed call by type, never by the message's words.
    `rank`: the rank found dead (None where the backend could not say which); `cause`: how it ended."""

    def __init__(self, message: str, rank: int | None = None, cause: str = ""):
        super().__init__(message)
        self.rank, self.cause = rank, cause

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.cause)


# The kind (RequestError.kind) of a request the numerics check (debug/numerics.py) ended: LLM.generate raises it as
# NonFiniteError, the server answers it with this code.
NON_FINITE = "non_finite"


class NonFiniteError(RuntimeError):
    """A request ended on a nan or inf its rows held (LLM.generate raises it once every prompt finished); the message
    names where it was born; `outputs`: every prompt's final RequestOutput, in prompt order."""

    def __init__(self, message: str, outputs: list | None = None):
        super().__init__(message)
        self.outputs = outputs or []
