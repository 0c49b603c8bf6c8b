"""HTTP server: the engine thread beside an asyncio event loop, behind FastAPI.

- `engine_loop.py`  EngineLoop: runs the engine on its own thread; thread-safe submit/abort; streams tokens
                    to per-request asyncio queues; a bounded waiting queue; graceful drain on shutdown.
- `protocol.py`     hardened JSON parsing, strict validation (400s), /generate bodies, error bodies, SSE framing.
- `openai_request.py`  the OpenAI fields both endpoints take (null = default, inert, neutral-only) and the
                    completions body; `chat.py` the chat body, Gemma 3's turns and chat response bodies.
- `chat_template.py`  messages -> prompt: --chat-template, the model's own template, or Gemma's turns.
- `choices.py`      n choices and prompt lists as engine requests side by side; log probabilities shaped.
- `openai_stream.py`  the SSE chunks of both OpenAI endpoints, for any number of choices.
- `openai_options.py`, `api_key.py`  --served-model-name, --api-key (Bearer), --chat-template, defaults.
- `body.py`         reading a body: JSON content type, size limit, read timeout.
- `site_guard.py`   Host and Origin checks (DNS rebinding, cross-site requests).
- `connections.py`  uvicorn's h11 protocol with a header timeout, a connection cap and lingering closes.
- `options.py`      ServerOptions and the `serve` command's limit and site options.
- `app.py`          the FastAPI app: /generate, /v1/completions, /v1/chat/completions, /v1/models, /metrics,
                    /health.
- `launch.py`       `swa-runtime serve`: announce each start-up phase, load the engine, run uvicorn, drain on
                    SIGTERM/SIGINT.
"""
