"""The HTTP gateway: an OpenAI-compatible API in front of the queue (``pagedq serve``).

The gateway is a producer like ``Client`` (it uses one): it validates requests
with the one schema (``pipeline/protocol.py``), enqueues them, and follows jobs
through Redis.  It keeps no state of its own in memory, so any number of
uvicorn workers (or hosts) can serve the same deployment.  The app factory is
``pagedq.pipeline.gateway.app.create_app``; see docs/http.md.
"""
