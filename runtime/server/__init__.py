"""HTTP server: the engine thread beside an asyncio event loop, behind FastAPI.

- `engine_loop.py`  EngineLoop: runs the engine on its own thread; thread-safe submit/abort; streams tokens
                    to per-request asyncio queues; a bounded waiting queue; graceful drain on shutdown.
- `protocol.py`     request bodies (hardened JSON parsing, pydantic strict validation), response and error
                    bodies, SSE framing.
- `body.py`         reading a body: JSON content type, size limit, read timeout.
- `site_guard.py`   Host and Origin checks (DNS rebinding, cross-site requests).
- `connections.py`  uvicorn's h11 protocol with a header timeout, a connection cap and lingering closes.
- `options.py`      ServerOptions and the `serve` command's limit and site options.
- `app.py`          the FastAPI app: /generate, /v1/completions, /v1/models, /metrics, /health.
- `launch.py`       `swa-runtime serve`: load the engine, run uvicorn, drain on SIGTERM/SIGINT.
"""
