"""A failed Orbax restore, reported once: its cause on one line, and none of the leftover noise it would print
on stderr later.

    with quiet_failed_restore():
        try:
            manager.restore(...)
        except Exception as e:
            raise DamagedCheckpoint(f"... ({cause_line(e)})") from e
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_failed_restore(wait_s: float = 5.0) -> Iterator[None]:
    """A failed Orbax restore leaves reads behind that Python reports on stderr, any time later: Orbax's
    readers catch BaseException, so closing the ones it abandoned raises again ("Exception ignored in:
    <coroutine ...>" with tensorstore's whole spec), tensorstore reads still in flight call back into Orbax's
    closed event loop ("RuntimeError: Event loop is closed"), and their futures are collected with an error
    nobody read (asyncio's "Future exception was never retrieved"). After a failure this waits (at most
    ``wait_s``) until the abandoned readers are released and collected, so none is left to be finalized at
    interpreter exit, where sys.unraisablehook no longer applies; the hook and the asyncio log filter keep
    dropping those kinds (only those) for the rest of the process, since a late callback has no end to wait
    for."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not _orbax_leftover(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    log = logging.getLogger("asyncio")
    log.addFilter(_unread_future_errors)
    try:
        yield
    except BaseException:
        deadline = time.monotonic() + wait_s
        gc.collect()
        while _live_orbax_readers() and time.monotonic() < deadline:
            time.sleep(0.05)
            gc.collect()
        raise
    sys.unraisablehook = previous
    log.removeFilter(_unread_future_errors)


def _unread_future_errors(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of a future or task whose error nobody read."""
    return "exception was never retrieved" not in str(record.msg)


def _live_orbax_readers() -> bool:
    return any(inspect.iscoroutine(o) and _from_orbax(o) for o in gc.get_objects())


def _from_orbax(coroutine) -> bool:
    return "orbax" in coroutine.cr_code.co_filename


def _orbax_leftover(unraisable) -> bool:
    if inspect.iscoroutine(unraisable.object):
        return _from_orbax(unraisable.object)
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
            and tb is not None and "asyncio" in tb.tb_frame.f_code.co_filename)


def innermost(e: BaseException) -> BaseException:
    """The exception at the bottom of ``e``'s chain of causes (Orbax wraps tensorstore's, which names the file)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def one_line(e: BaseException, limit: int = 400) -> str:
    """An exception's message on one line, without tensorstore's spec dump; a long one keeps its start and its
    end (tensorstore nests "context: context: detail")."""
    text = " ".join(str(e).split(" [tensorstore_spec")[0].split(" See full TensorStore details")[0].split())
    return text if len(text) <= limit else f"{text[: limit // 4]} ... {text[-(limit * 3 // 4):]}"




def cause_line(e: BaseException) -> str:
    """The innermost cause of ``e`` (tensorstore's, which names the file) as ``Type: message`` on one line."""
    cause = innermost(e)
    return f"{type(cause).__name__}: {one_line(cause)}"
