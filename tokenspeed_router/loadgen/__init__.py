"""Trace load generator: replay a Mooncake-format trace against any OpenAI endpoint.

``tokenspeed-router loadgen`` (DESIGN §11) sends each trace request as a
streamed ``/v1/completions`` call at its (time-scaled) arrival time, open
loop, and reports TTFT, inter-token latency, end-to-end latency, the
engine-reported prefix cache hit ratio and the spread of requests over
workers. No torch: it runs beside a router, not an engine.
"""

from tokenspeed_router.loadgen.client import RequestRecord, send_request
from tokenspeed_router.loadgen.prompts import (
    PromptBuilder,
    PromptConfig,
    PromptFormat,
    scale_prompts,
)
from tokenspeed_router.loadgen.replay import (
    ReplayConfig,
    ReplayOutcome,
    completions_url,
    discover_model,
    replay,
    replay_async,
)
from tokenspeed_router.loadgen.report import format_runs_table, summarize, write_plots

__all__ = [
    "PromptBuilder",
    "PromptConfig",
    "PromptFormat",
    "ReplayConfig",
    "ReplayOutcome",
    "RequestRecord",
    "completions_url",
    "discover_model",
    "format_runs_table",
    "replay",
    "replay_async",
    "scale_prompts",
    "send_request",
    "summarize",
    "write_plots",
]
