"""User-facing errors: the CLI prints their message on one line and exits non-zero, the server maps
them to 4xx JSON errors. Anything else that escapes is a bug."""


class SpeculateError(ValueError):
    """A bad input or setting the user can fix (unknown model, k < 1, prompt too long, ...)."""


class ContextLengthError(SpeculateError):
    """A prompt and its new tokens do not fit the model's context window (the server: 400
    ``context_length_exceeded``, as OpenAI says it)."""


class StorageError(SpeculateError):
    """The machine's storage failed us (a full disk, a read-only cache): one line on the command line, as any
    SpeculateError; a server fault for a request that met it (507), not the request's (4xx)."""


# What a write's OSError says when the fault is the storage itself, not the path the user gave.
STORAGE_ERRNOS = {28, 30, 122}  # ENOSPC, EROFS, EDQUOT


class SpeculateWarning(RuntimeWarning):
    """Something the user should know that does not stop the run (a slow precision, an exactness fallback): the
    CLI prints it on one line."""
