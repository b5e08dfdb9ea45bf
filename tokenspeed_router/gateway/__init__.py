"""The OpenAI-compatible gateway inside ``tokenspeed-router serve`` (DESIGN §10).

Modules, one job each:

* ``config``    — :class:`GatewayConfig` (imported by ``server/config.py``)
* ``openai``    — request parsing and OpenAI's error shape
* ``tokenize``  — prompt -> token ids (the engine's ``/tokenize`` or a local HF tokenizer)
* ``upstream``  — the pooled HTTP client, worker URLs, down marking and probes
* ``truth``     — predicted vs engine-reported cached tokens; ``misaligned`` workers
* ``sse``       — relaying an SSE stream event by event (usage stripping)
* ``proxy``     — one request: route, forward (with retries), relay, release; P/D legs
* ``app``       — the ASGI endpoints mounted into the router's Starlette app

Nothing is imported here eagerly: ``server/config.py`` imports
``gateway.config`` while the server package itself is being imported.
"""
