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
        self._next = 0  # where the next call starts reading (after a pass cut short by max_items)
        self._poller = zmq.Poller()
        self._poller_key: tuple[zmq.Socket[bytes], ...] = ()
        self._owners: dict[zmq.Socket[bytes], EventSubscriber] = {}
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
        max_items: int | None = None,
    ) -> tuple[list[SubscriberItem], list[zmq.Socket[bytes]]]:
        """:meth:`poll`, also watching the caller's own ``watch`` sockets (the
        server's connection monitors): returns the items and the watched sockets
        found readable. With ``on_error``, a subscriber whose
        :meth:`EventSubscriber.process_ready` raises is reported (called inside
        the ``except`` block) and the others go on; without it the error
        propagates. With ``max_items``, a subscriber reads at most the room left
        and none is read once that many items are out (the others stay ready
        for the next call, which starts with them).
        """
        out: list[SubscriberItem] = []
        start, subs = self._rotated()
        for sub in subs:
            if sub.needs_processing():
                self._process(sub, out, on_error)
        if out:
            return out, []
        poller, owners = self._poller_for(subs, watch)
        wait_s = timeout_s
        for sub in subs:
            hint = sub.timeout_hint_s()
            if hint is not None and hint < wait_s:
                wait_s = hint
        ready_socks = [sock for sock, _ in poller.poll(max(0, int(wait_s * 1000)))]
        ready = {owners[sock] for sock in ready_socks if sock in owners}
        for i, sub in enumerate(subs):
            room = None if max_items is None else max_items - len(out)
            if room is not None and room <= 0:
                self._next = (start + i) % len(subs)  # the ones not read go first next time
                break
            if sub in ready or sub.needs_processing():
                self._process(sub, out, on_error, room)
        return out, [sock for sock in ready_socks if sock not in owners]

    def _rotated(self) -> tuple[int, list[EventSubscriber]]:
        """The subscribers, starting where the last call stopped reading (and where that is)."""
        subs = list(self._subs.values())
        k = self._next % len(subs) if subs else 0
        self._next = 0
        return k, (subs[k:] + subs[:k] if k else subs)

    def _poller_for(
        self, subs: list[EventSubscriber], watch: Sequence[zmq.Socket[bytes]]
    ) -> tuple[zmq.Poller, dict[zmq.Socket[bytes], EventSubscriber]]:
        """One poller over the subscribers' sockets and ``watch``, rebuilt only when that set
        changes (a replay's DEALER comes and goes; streams are added and removed): building
        one registers every socket again, a cost paid per pass before."""
        owners: dict[zmq.Socket[bytes], EventSubscriber] = {}
        for sub in subs:
            for sock in sub.poll_sockets():
                owners[sock] = sub
        key = (*owners, *watch)
        if key != self._poller_key:
            poller = zmq.Poller()
            for sock in key:
                poller.register(sock, zmq.POLLIN)
            self._poller, self._poller_key, self._owners = poller, key, owners
        return self._poller, self._owners

    @staticmethod
    def _process(
        sub: EventSubscriber,
        out: list[SubscriberItem],
        on_error: Callable[[EventSubscriber], None] | None,
        max_messages: int | None = None,
    ) -> None:
        try:
            out.extend(sub.process_ready() if max_messages is None else sub.process_ready(max_messages))
        except Exception:
            if on_error is None:
                raise
            on_error(sub)

    def statistics(self) -> dict[str, SubscriberStatistics]:
        return {worker: sub.statistics() for worker, sub in self._subs.items()}

    def close(self) -> None:
        """Close every subscriber in the group."""
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
