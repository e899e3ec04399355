"""Celery's configuration, derived from Settings.

- JSON only on the wire: pickle is never accepted.
- ``acks_late`` + ``worker_prefetch_multiplier=1``: a worker reserves only as
  many messages as it can serve at once, and acknowledges each when its task
  is done, so a worker that dies takes nothing with it.
- Priority: kombu's Redis transport keeps one list per priority step and pops
  the lowest number first (0 = most urgent), the reverse of pagedq's 0-9 scale
  where 9 is most urgent; producers send ``names.broker_priority(p) = 9 - p``.
- ``visibility_timeout``: a message a worker took but never acknowledged (the
  worker was killed; a warm shutdown requeues at once) becomes visible again
  after this many seconds.  It must exceed the longest time a live worker
  holds a message (queued in its engine plus generating), or a slow job is
  delivered twice (harmless, as results publish once, but wasted work).
  Default 3600 s (``PAGEDQ_VISIBILITY_TIMEOUT_S``); consumers sweep for such
  messages every min(10, visibility_timeout) s.
- Events on, so Flower sees every task.
- The Redis transport is kombu's, hardened so garbage pushed onto a queue is
  logged and dropped instead of stopping the worker (``transport.py``).
"""

from __future__ import annotations

from celery import Celery, signals

from pagedq.config.names import KOMBU_PRIORITY_SEP, PRIORITY_STEPS, Names, broker_priority
from pagedq.config.redis_server import broker_url
from pagedq.config.settings import Settings
from pagedq.config.transport import TRANSPORT


def celery_config(settings: Settings, url: str) -> dict:
    names = Names.from_settings(settings)
    return dict(
        broker_url=url,
        **({"broker_transport": TRANSPORT} if url.startswith("redis://") else {}),
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "priority_steps": PRIORITY_STEPS,
            "sep": KOMBU_PRIORITY_SEP,
            "queue_order_strategy": "priority",
            "visibility_timeout": settings.visibility_timeout_s,
            # Sweep for expired unacked messages every few seconds (kombu's default is ~100 s).
            "unacked_restore_interval": min(10, settings.visibility_timeout_s),
            "unacked_restore_throttle": 1,
            "global_keyprefix": settings.key_prefix,
        },
        accept_content=["json"],
        result_accept_content=["json"],
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,  # results live in pagedq's own keys, written atomically
        task_default_queue=names.default_queue,
        task_default_priority=broker_priority(settings.default_priority),
        event_exchange=names.event_exchange,
        control_exchange=names.control_exchange,
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_disable_rate_limits=True,
    )


def make_celery(settings: Settings, url: str | None = None, main: str = "pagedq") -> Celery:
    app = Celery(main, set_as_current=False)
    app.conf.update(celery_config(settings, url or broker_url(settings)))
    return app


def mark_ready_on_start(r, key: str) -> None:
    """Set ``ready`` in a worker's Redis record once its Celery consumer is up."""

    def on_ready(**_) -> None:
        r.hset(key, "ready", 1)

    signals.worker_ready.connect(on_ready, weak=False)
