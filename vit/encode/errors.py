"""The encode job's error: what the command line prints as one line and turns into its exit status."""

from __future__ import annotations

__all__ = ["EXIT_RUNTIME", "EXIT_USAGE", "EncodeError", "require_pyarrow"]

# A bad argument, an input set, checkpoint or output that cannot be used (found before encoding where it can be).
EXIT_USAGE = 2
# A failure while encoding that no argument explains (out of memory).
EXIT_RUNTIME = 1


class EncodeError(Exception):
    """An option, checkpoint or output the job cannot use, or a failure that ends it: the message is one line that
    starts with the file or option it is about; ``status`` is the command's exit status (:data:`EXIT_USAGE` unless
    given)."""

    def __init__(self, message: str, status: int = EXIT_USAGE):
        super().__init__(message)
        self.status = status


def require_pyarrow(what: str):
    """pyarrow, with its Parquet and IPC readers, for ``what`` (the start of the message: the file or option that
    needs it); an :class:`EncodeError` naming the ``data`` extra where it is not installed."""
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise EncodeError(f"{what} needs pyarrow; pip install 'qvl[data]'") from None
    return pyarrow
