"""kombu's Redis transport, hardened against garbage on a queue.

Stock kombu decodes each popped list item inside the worker's event loop; an
item that is not JSON, or JSON without a message envelope's fields, raises
there and takes the whole worker down.  This channel logs such an item and
drops it (it was already popped), and the worker carries on.  Envelopes that
are well formed but carry a bad body (wrong content type, pickle, unknown
task, wrong arguments) are Celery's to reject, and it logs them too.
"""

from __future__ import annotations

import logging
from queue import Empty

from kombu.transport import redis as kombu_redis

log = logging.getLogger("pagedq.transport")

_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, IndexError)


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except _MALFORMED as e:
            log.error("dropped a malformed message (not a kombu JSON envelope): %s: %s", type(e).__name__, e)
            return True

    def _get(self, queue):
        try:
            return super()._get(queue)
        except _MALFORMED as e:
            log.error("dropped a malformed message from %s: %s: %s", queue, type(e).__name__, e)
            raise Empty() from None


class Transport(kombu_redis.Transport):
    Channel = Channel

