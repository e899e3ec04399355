"""``pagedq serve``: the gateway under uvicorn, with the binding rule for API keys.

Without a keys file every request is served as one anonymous tenant, so the
gateway binds only a loopback address; asked to bind anything else without
keys, it refuses to start.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from pagedq.config import Settings
from pagedq.pipeline.gateway.config import KEYS_FILE_VARIABLE, GatewayConfig
from pagedq.pipeline.gateway.keys import KeyRing, KeysFileError
from pagedq.pipeline.local.stack import settings_env
from pagedq.store.connection import broker_url


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def raise_open_files_limit(wanted: int = 65536) -> int:
    """Lift the soft limit on open files toward ``wanted`` (within the hard limit): every client connection is a
    file descriptor, and 1,024 (a common soft limit) is too few for a thousand streams.  Returns the limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def _say(message: str) -> None:
    print(f"pagedq serve: {message}", file=sys.stderr, flush=True)


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000, workers: int = 1,
          log_level: str = "info", **config: object) -> int:
    """Run the gateway until interrupted.  ``config``: GatewayConfig fields (None: the default); the keys
    file defaults to ``PAGEDQ_API_KEYS_FILE``."""
    import uvicorn

    given = {k: v for k, v in config.items() if v is not None}
    given.setdefault("api_keys_file", os.environ.get(KEYS_FILE_VARIABLE) or None)
    try:
        gateway_config = GatewayConfig(**given)
    except ValidationError as e:
        err = e.errors()[0]
        _say(f"{'.'.join(map(str, err['loc']))}: {err['msg']}")
        return 2
    keys_file = gateway_config.api_keys_file
    if keys_file is None:
        if not is_loopback(host):
            _say(f"refusing to bind {host} without API keys: set {KEYS_FILE_VARIABLE} (or --api-keys-file), "
                 "or bind a loopback address")
            return 2
        _say(f"no API keys file ({KEYS_FILE_VARIABLE}): serving on loopback only, without authentication")
    else:
        try:
            ring = KeyRing.load(keys_file)
        except KeysFileError as e:
            _say(str(e))
            return 2
        gateway_config = gateway_config.model_copy(update={"api_keys_file": Path(keys_file).resolve()})
        _say(f"{len(ring)} API key(s) from {keys_file}")
    url = broker_url(settings)  # BrokerNotFoundError: nothing to serve from
    os.environ.update(settings_env(settings))  # the factory in every uvicorn worker builds the same settings
    os.environ["PAGEDQ_BROKER_URL"] = url
    gateway_config.hand_off()
    open_files = raise_open_files_limit()
    _say(f"http://{host}:{port} ({workers} worker process(es), each serving at most "
         f"{settings.gateway_limit_concurrency} completion requests at once; {open_files} open files)")
    uvicorn.run("pagedq.pipeline.gateway.app:create_app", factory=True, host=host, port=port, workers=workers,
                log_level=log_level, timeout_graceful_shutdown=5)
    return 0
