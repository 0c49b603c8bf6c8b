"""HTTP server: the engine thread beside an asyncio event loop, behind FastAPI.

- `engine_loop.py`  EngineLoop: runs the scheduler on its own thread; thread-safe submit/abort; streams
                    tokens to per-request asyncio queues; graceful drain on shutdown.
- `protocol.py`     request bodies (pydantic, strict), response and error bodies, SSE framing.
- `app.py`          the FastAPI app: /generate, /v1/completions, /v1/models, /metrics, /health.
- `launch.py`       `swa-runtime serve`: load the engine, run uvicorn, drain on SIGTERM/SIGINT.
"""
