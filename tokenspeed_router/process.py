"""Process life cycle shared by the long-running commands.

``serve``, ``relay`` and ``engine-sim`` all stop cleanly on SIGTERM or SIGINT
(flush the event log, close sockets, exit 0); the signal handling that makes
them do so is defined once, here, below all of them.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["shutdown_signals"]

logger = logging.getLogger(__name__)


@contextmanager
def shutdown_signals(on_signal: Callable[[], None]) -> Iterator[None]:
    """Route SIGTERM/SIGINT to ``on_signal`` (main thread only) and restore afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        logger.info("received %s: shutting down", signal.Signals(signum).name)
        on_signal()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
