"""The one-machine stack: the embedded redis-server and the worker processes of ``pagedq up``."""
