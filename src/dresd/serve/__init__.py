"""`dresd serve`: an OpenAI-compatible HTTP server, a thin layer over the speculative loop.

    engine.py    the model, its drafters, the request queue and the one worker thread
    protocol.py  OpenAI's request and response formats; streamed text, stop strings
    app.py       the FastAPI routes, errors, server-sent events, one log line per request
    metrics.py   GET /metrics in Prometheus' text format, named as vLLM names its figures
    auth.py      the API key (--api-key): Bearer check, OpenAI's 401, the exposure warning
    ray_serve.py --ray --replicas N: the same app on Ray Serve replicas, /metrics pooled
    local.py     a server process on 127.0.0.1 for tests and benchmarks

The `serve` subcommand (options, loading, then uvicorn) is `dresd/cli/serve.py`.

Nothing here imports FastAPI at `dresd` start-up: the server's packages are an extra
(`pip install 'dresd[serve]'`), and nothing imports Ray but ray_serve.py, with --ray only.
"""
