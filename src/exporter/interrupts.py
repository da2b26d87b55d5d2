"""SIGINT and SIGTERM: recorded once, raised at once, and checked again wherever a run could go on.

The handler records the signal and raises :class:`Stop` (a ``BaseException``, so no stage's
``except Exception`` catches it). Python discards an exception raised inside a weakref callback or a
``__del__``, so raising is not enough: the recorded signal is checked again at every stage boundary,
on every wait for a child process, in every benchmark round and right before an output folder is
published (:func:`check`). Once a signal is recorded, nothing can publish until the next run.

A stop prints one line. Python's logging is silenced from the signal to the end of the watched block: a library
that logs the exception a stop raised inside it (torch's fake tensors log "failed while attempting to run meta"
with a traceback when a signal lands in a meta kernel during ``torch.export``, the stop having reached them
wrapped) would otherwise print a traceback after the user asked the run to stop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator

from .errors import Interrupted

_received: int | None = None
_depth = 0


class Stop(BaseException):
    """A signal in flight; :func:`watch` turns it into :class:`~exporter.errors.Interrupted`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def received() -> int | None:
    """The signal recorded since :func:`watch` began, if any."""
    return _received


def check() -> None:
    """Raise :class:`Stop` if a signal was recorded (a raise the handler made may have been discarded)."""
    if _received is not None and _depth:  # outside a watched block, a signal an earlier block ended on is spent
        raise Stop(_received)


def _on_signal(signum, frame) -> None:
    """The first signal raises; a second one (Ctrl-C pressed again, or sent by a supervising parent as well as by
    the terminal) is already recorded and must not break off the cleanup the first one started."""
    global _received
    if _received is not None:
        return
    _received = signum
    logging.disable(logging.CRITICAL)  # until watch() ends: no library's log of the stop (module docstring)
    raise Stop(signum)


@contextlib.contextmanager
def watch() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM stop the run; on the way out they become ``Interrupted``."""
    global _received, _depth
    if _depth or threading.current_thread() is not threading.main_thread():
        # nested: the outer block already watches; another thread: only the main thread can set handlers
        yield
        return
    _received = None
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    unraisable = sys.unraisablehook

    def quiet_stop(info) -> None:
        """A Stop discarded in a ``__del__`` is recorded already: no "Exception ignored" traceback for it."""
        if not isinstance(info.exc_value, Stop):
            unraisable(info)

    sys.unraisablehook = quiet_stop
    _depth += 1
    try:
        yield
        check()
    except Stop as exc:
        raise Interrupted(exc.signum) from None
    except KeyboardInterrupt:  # a SIGINT that came before the handler was set, or from a library's own handler
        raise Interrupted(signal.SIGINT) from None
    finally:
        _depth -= 1
        sys.unraisablehook = unraisable
        if _received is not None:
            logging.disable(logging.NOTSET)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


__all__ = ["Stop", "check", "received", "watch"]
