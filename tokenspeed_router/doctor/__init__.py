"""``tokenspeed-router doctor``: prove, before traffic arrives, that the router and the engines agree.

Per engine, a canary prompt made of unique tokens goes to the engine's own
API (never through ``/route``), and the engine's KV events, its usage answers
and the router's own tokenizer, hashing and prediction are compared (DESIGN
§13). Modules, one job each:

* :mod:`.canary`: canary prompts (unique words, the token-id probe length);
* :mod:`.engine_api`: the engine's OpenAI API (completions, chat, models);
* :mod:`.watcher`: the engine's KV event streams, followed with the router's
  own :class:`~tokenspeed_router.events.EventSubscriber` and folded into a
  :class:`~tokenspeed_router.router.KvIndex`;
* :mod:`.views`: what the router computes (the ``--tokenizer`` in-process, or
  a running router's ``POST /doctor/expect`` and ``POST /match``);
* :mod:`.checks`: the named checks, their causes and the flags that fix them;
* :mod:`.engine_run`: the probe sequence for one engine;
* :mod:`.report`: one line per engine and check, or JSON; the exit code;
* :mod:`.cli_doctor`: the command line.
"""

from tokenspeed_router.doctor.checks import CHECK_NAMES, Check
from tokenspeed_router.doctor.report import DoctorReport, EngineReport

__all__ = ["CHECK_NAMES", "Check", "DoctorReport", "EngineReport"]
