"""User-facing errors: the CLI prints their message on one line and exits non-zero, the server maps
them to 4xx JSON errors. Anything else that escapes is a bug."""


class SpeculateError(ValueError):
    """A bad input or setting the user can fix (unknown model, k < 1, prompt too long, ...)."""
