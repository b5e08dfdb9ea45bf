"""The offline tools: ``record``, ``replay``, ``inspect`` and decision replay.

They read and write event logs and decision logs, and rebuild an index or
re-decide logged requests away from any serving process; ``server/`` is only
the router process itself. Tools depend on ``server`` (they reuse its
configuration and, for ``replay --serve``, its HTTP app), never the reverse.
"""
