"""SubscriberGroup: many :class:`EventSubscriber` s polled through one zmq poller.

The server's ingestion thread follows every worker's stream from one thread;
the group is what lets it wait on all of their sockets (and its own
connection monitors) at once, while each subscriber keeps its own ordering
guarantees (``subscriber.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import zmq

from tokenspeed_router.events.subscriber import (
    EventSubscriber,
    SubscriberItem,
    SubscriberStatistics,
)

__all__ = ["SubscriberGroup"]


class SubscriberGroup:
    """Poll many subscribers at once (one zmq poller over all their sockets).

    The server's ingestion thread polls its streams through one group (with
    its connection monitors as extra ``watch`` sockets, see :meth:`poll_with`).

    Items of one worker keep their order; items of different workers are
    interleaved in the order their sockets were found ready.
    """

    def __init__(self, subscribers: Iterable[EventSubscriber] = ()) -> None:
        self._subs: dict[str, EventSubscriber] = {}
        for sub in subscribers:
            self.add(sub)

    def add(self, subscriber: EventSubscriber) -> None:
        if subscriber.worker in self._subs:
            raise ValueError(f"duplicate worker {subscriber.worker!r} in SubscriberGroup")
        self._subs[subscriber.worker] = subscriber

    def remove(self, worker: str) -> EventSubscriber:
        """Take a subscriber out of the group (the caller closes it)."""
        return self._subs.pop(worker)

    def get(self, worker: str) -> EventSubscriber | None:
        return self._subs.get(worker)

    @property
    def workers(self) -> list[str]:
        return list(self._subs)

    def __iter__(self) -> Iterator[EventSubscriber]:
        return iter(list(self._subs.values()))

    def __len__(self) -> int:
        return len(self._subs)

    def poll(self, timeout_s: float) -> list[SubscriberItem]:
        """Wait up to ``timeout_s`` for any subscriber, then return all ready items."""
        return self.poll_with(timeout_s)[0]

    def poll_with(
        self,
        timeout_s: float,
        watch: Sequence[zmq.Socket[bytes]] = (),
        on_error: Callable[[EventSubscriber], None] | None = None,
    ) -> tuple[list[SubscriberItem], list[zmq.Socket[bytes]]]:
        """:meth:`poll`, also watching the caller's own ``watch`` sockets (the
        server's connection monitors): returns the items and the watched sockets
        found readable. With ``on_error``, a subscriber whose
        :meth:`EventSubscriber.process_ready` raises is reported (called inside
        the ``except`` block) and the others go on; without it the error
        propagates.
        """
        out: list[SubscriberItem] = []
        subs = list(self._subs.values())
        for sub in subs:
            if sub.needs_processing():
                self._process(sub, out, on_error)
        if out:
            return out, []
        poller = zmq.Poller()
        owners: dict[zmq.Socket[bytes], EventSubscriber] = {}
        wait_s = timeout_s
        for sub in subs:
            for sock in sub.poll_sockets():
                poller.register(sock, zmq.POLLIN)
                owners[sock] = sub
            hint = sub.timeout_hint_s()
            if hint is not None:
                wait_s = min(wait_s, hint)
        for sock in watch:
            poller.register(sock, zmq.POLLIN)
        ready_socks = [sock for sock, _ in poller.poll(max(0, int(wait_s * 1000)))]
        ready = {owners[sock] for sock in ready_socks if sock in owners}
        for sub in subs:
            if sub in ready or sub.needs_processing():
                self._process(sub, out, on_error)
        return out, [sock for sock in ready_socks if sock not in owners]

    @staticmethod
    def _process(
        sub: EventSubscriber,
        out: list[SubscriberItem],
        on_error: Callable[[EventSubscriber], None] | None,
    ) -> None:
        if on_error is None:
            out.extend(sub.process_ready())
            return
        try:
            out.extend(sub.process_ready())
        except Exception:
            on_error(sub)

    def statistics(self) -> dict[str, SubscriberStatistics]:
        return {worker: sub.statistics() for worker, sub in self._subs.items()}

    def close(self) -> None:
        """Close every subscriber in the group."""
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
