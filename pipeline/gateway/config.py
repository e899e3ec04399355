"""The gateway's own configuration and Redis key names.

``GatewayConfig`` comes from ``pagedq serve``'s flags (and ``PAGEDQ_API_KEYS_FILE``);
``serve`` hands it to its uvicorn worker processes in ``HANDOFF_VARIABLE``.
The gateway's keys all live under ``<key_prefix>gw:``, so they share a
deployment's Redis (and its prefix) with the queue's keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pagedq.config.settings import parse_bytes

KEYS_FILE_VARIABLE = "PAGEDQ_API_KEYS_FILE"
HANDOFF_VARIABLE = "_PAGEDQ_GATEWAY_CONFIG"  # JSON of a GatewayConfig, from `pagedq serve` to its uvicorn workers

Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(ge=1)]


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_keys_file: Path | None = Field(
        None, description="JSON or TOML file of hashed API keys and their tenants; None = loopback only, no auth")
    max_file_bytes: Bytes = Field(64 << 20, description="largest file POST /v1/files accepts (413 beyond)")
    max_request_bytes: Bytes = Field(4 << 20, description="largest JSON request body (413 beyond)")
    file_ttl_s: int = Field(30 * 24 * 3600, ge=1, description="uploaded files and batch output files expire after this")
    max_batch_lines: int = Field(50_000, ge=1, description="most requests one batch input file may hold")

    @classmethod
    def from_env(cls) -> GatewayConfig:
        """What ``pagedq serve`` handed over, else the defaults with ``PAGEDQ_API_KEYS_FILE``."""
        handed = os.environ.get(HANDOFF_VARIABLE)
        if handed:
            return cls.model_validate(json.loads(handed))
        return cls(api_keys_file=os.environ.get(KEYS_FILE_VARIABLE) or None)

    def hand_off(self) -> None:
        """Make ``from_env`` in processes started from now on (uvicorn's workers) return this config."""
        os.environ[HANDOFF_VARIABLE] = self.model_dump_json()


@dataclass(frozen=True)
class GatewayKeys:
    """Every Redis key the gateway adds (beside the queue's keys from ``config/names.py``)."""

    key_prefix: str = "pagedq:"

    @property
    def _base(self) -> str:
        return f"{self.key_prefix}gw:"

    def file(self, file_id: str) -> str:
        """Hash: a file's tenant, filename, purpose, bytes, created_at, expires_at."""
        return f"{self._base}file:{file_id}"

    def file_content(self, file_id: str) -> str:
        """String (bytes): a file's content."""
        return f"{self._base}file:{file_id}:content"

    def files_of(self, tenant: str) -> str:
        """Sorted set: a tenant's file ids by creation time."""
        return f"{self._base}files:{tenant}"

    def file_staging(self, file_id: str) -> str:
        """String (bytes, short TTL): a batch output file or an upload being written chunk by chunk; renamed to its
        content key once whole."""
        return f"{self._base}file:{file_id}:staging"

    @property
    def storage_ledger(self) -> str:
        """Hash: file id -> "<bytes> <tenant>" for every file stored or being written (outlives the files,
        which expire on their own: ``storage_expiry`` says when to settle an entry)."""
        return f"{self._base}storage:ledger"

    @property
    def storage_expiry(self) -> str:
        """Sorted set: file id -> when its ledger entry lapses (its file's expiry, or a reservation's end)."""
        return f"{self._base}storage:expiry"

    @property
    def storage_usage(self) -> str:
        """Hash: ``bytes:<tenant>`` and ``files:<tenant>`` per tenant, ``bytes`` for all: the ledger's sums."""
        return f"{self._base}storage:usage"

    def batch(self, batch_id: str) -> str:
        """Hash: an OpenAI batch's tenant, input file, endpoint, metadata, its quotas for its output files
        and, once done, its status, counts and output files."""
        return f"{self._base}batch:{batch_id}"

    def finalize_lock(self, batch_id: str) -> str:
        """String with a TTL (an owner token): held by the process writing the batch's output files."""
        return f"{self._base}batch:{batch_id}:finalizing"

    def batches_of(self, tenant: str) -> str:
        """Sorted set: a tenant's batch ids by creation time."""
        return f"{self._base}batches:{tenant}"

    def active_jobs(self, tenant: str) -> str:
        """Sorted set: a tenant's job ids (and short-lived reservations) that may still be waiting or running."""
        return f"{self._base}active:{tenant}"

    def requests_in_minute(self, tenant: str, minute: int) -> str:
        """Counter: a tenant's requests in one clock minute."""
        return f"{self._base}rpm:{tenant}:{minute}"
