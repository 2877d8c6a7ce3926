"""User-facing errors: the CLI prints their message on one line and exits non-zero, the server maps
them to 4xx JSON errors. Anything else that escapes is a bug."""


class SpeculateError(ValueError):
    """A bad input or setting the user can fix (unknown model, k < 1, prompt too long, ...)."""


class SpeculateWarning(RuntimeWarning):
    """Something the user should know that does not stop the run (a slow precision, an exactness fallback): the
    CLI prints it on one line."""
