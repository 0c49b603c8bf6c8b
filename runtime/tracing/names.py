"""Span, attribute and event names of the traces: what collectors, dashboards and tests look up.

Request attributes use vLLM's names (its `SpanAttributes`, `gen_ai.*`) where it has one, so that a trace
backend set up for vLLM reads these spans too; the rest are this runtime's own, under `swa_runtime.*`.
"""

from telemetry.names import LOC_KEY_CHANGE_EVENT

TRACER_NAME = "swa_runtime"
SERVICE_NAME = "swa-runtime"

# ---- the request: a root span (SERVER) with one child span per phase ----------------------------------------
REQUEST_SPAN = "llm_request"
QUEUE_SPAN = "queue"  # arrival -> admission into the running batch
PREFILL_SPAN = "prefill"  # admission -> first token
DECODE_SPAN = "decode"  # first token -> finish

REQUEST_ID = "gen_ai.request.id"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
REQUEST_STATUS = "swa_runtime.request.status"  # finished | aborted | error (the requests_total status)
REQUEST_RETRACTIONS = "swa_runtime.request.retractions"

RETRACTED_EVENT = "retracted"  # on the request span: its KV left the device (attribute `kind`)
READMITTED_EVENT = "readmitted"  # on the request span: admitted again after a retraction

# ---- the forward: a root span (INTERNAL) linked to the request spans of its batch ---------------------------
FORWARD_SPAN = "forward"
FORWARD_ID = "swa_runtime.forward.id"
FORWARD_MODE = "swa_runtime.forward.mode"
FORWARD_BATCH_SIZE = "swa_runtime.forward.batch_size"
FORWARD_TOKENS = "swa_runtime.forward.tokens"
LOC_CACHE_POLICY = "swa_runtime.loc_cache.policy"

# Key-change and sanitizer events: on the forward span with every field of the log record (classification,
# site, policy, ...); on each linked request span once per (forward, classification), naming the forward.
KV_EVENT = LOC_KEY_CHANGE_EVENT  # the log record's event name
BENIGN_CLASSIFICATIONS = frozenset({"benign_fresh_tensor"})  # on the forward span only
