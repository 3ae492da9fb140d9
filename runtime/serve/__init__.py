"""deepinfer-serve: an OpenAI-compatible HTTP server over the engine (an optional extra:
starlette, uvicorn, prometheus_client, jinja2, imported only here)."""
