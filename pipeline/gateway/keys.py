"""API keys and the tenants they stand for.

The keys file (``PAGEDQ_API_KEYS_FILE``, JSON or TOML) holds only the SHA-256
of each key, never the key itself::

    {"keys": [{"sha256": "<hex of sha256(key)>", "tenant": "team-a",
               "max_priority": 7, "rpm": 600, "max_queued": 100,
               "max_stored_bytes": "1GiB", "max_files": 1000, "weight": 2}]}

``printf %s "$KEY" | python -m pagedq.pipeline.gateway.keys`` (or ``--file
PATH``) prints the line for a key: the key is read from stdin or a file, never
from the command line, where every user of the host can read it.
Several keys may name the same tenant; a tenant's limits are those of the
first key that names it.  ``weight`` (default 1) is the tenant's share of service
within a priority band, relative to the other tenants' weights.  ``cache_group``
names tenants that may share cached answers and prompt blocks (default: none,
each tenant's caches are its own).  The tenant name ``default`` is reserved: it
is the tenant of every job submitted without one (``Client``, the CLI,
``run-batch``), so a key for it could read and cancel them all.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from pagedq.config.scheduling import DEFAULT_TENANT
from pagedq.config.settings import parse_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


DEFAULT_MAX_STORED_BYTES = 1 << 30
DEFAULT_MAX_FILES = 1000


@dataclass(frozen=True)
class Tenant:
    """Who a request is from, and what it may do."""

    name: str
    max_priority: int = 9  # the highest job priority (0-9) this tenant may ask for
    rpm: int | None = None  # requests per minute; None: unlimited
    max_queued: int | None = None  # jobs waiting or running at once; None: unlimited
    max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES  # bytes kept at once: files, stored responses, results
    max_files: int = DEFAULT_MAX_FILES  # files kept at once (a batch holds two places for its output files)
    weight: float = 1.0  # share of service within a priority band, relative to other tenants' weights
    cache_group: str | None = None  # tenants that may share cached answers and prompt blocks; None: its own

    @property
    def cache_scope(self) -> str:
        """Whose cached answers and prompt blocks this tenant's requests may use (``cache_salt``)."""
        return f"group:{self.cache_group}" if self.cache_group else f"tenant:{self.name}"


ANONYMOUS = Tenant(DEFAULT_TENANT)  # every request, when the gateway runs without a keys file (loopback only)


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
    tenant: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@-]+$")]
    max_priority: Annotated[int, Field(ge=0, le=9)] = 9
    rpm: Annotated[int, Field(ge=1)] | None = None
    max_queued: Annotated[int, Field(ge=1)] | None = None
    max_stored_bytes: Annotated[int, BeforeValidator(parse_bytes), Field(ge=0)] = DEFAULT_MAX_STORED_BYTES
    max_files: Annotated[int, Field(ge=0)] = DEFAULT_MAX_FILES
    weight: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    cache_group: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@-]+$")] | None = None

    @field_validator("tenant")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v == DEFAULT_TENANT:
            raise ValueError(f"{DEFAULT_TENANT!r} is reserved: it is the tenant of every job submitted without one "
                             "(Client, CLI, run-batch); name the tenant otherwise")
        return v


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[_KeyEntry]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeysFileError(ValueError):
    pass


class KeyRing:
    """The tenants of a keys file, found by a request's bearer token."""

    def __init__(self, tenants_by_hash: dict[str, Tenant]) -> None:
        self._by_hash = tenants_by_hash

    @classmethod
    def load(cls, path: Path | str) -> KeyRing:
        path = Path(path)
        try:
            text = path.read_text()
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
            entries = _KeysFile.model_validate(raw).keys
        except (OSError, ValueError, tomllib.TOMLDecodeError) as e:
            detail = e.errors()[0] if isinstance(e, ValidationError) else e
            raise KeysFileError(f"API keys file {path}: {detail}") from None
        if not entries:
            raise KeysFileError(f"API keys file {path}: holds no keys (nobody could use the gateway)")
        first: dict[str, Tenant] = {}
        by_hash = {}
        for entry in entries:
            tenant = first.setdefault(entry.tenant, Tenant(entry.tenant, entry.max_priority, entry.rpm,
                                                           entry.max_queued, entry.max_stored_bytes,
                                                           entry.max_files, entry.weight, entry.cache_group))
            by_hash[entry.sha256.lower()] = tenant
        return cls(by_hash)

    def __len__(self) -> int:
        return len(self._by_hash)

    def tenants(self) -> list[Tenant]:
        """Every tenant of the keys file, once."""
        return list({t.name: t for t in self._by_hash.values()}.values())

    def tenant_for(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, or None."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._by_hash.get(hash_key(key.strip()))


USAGE = ("usage: printf %s \"$KEY\" | python -m pagedq.pipeline.gateway.keys   (or: ... keys --file PATH)\n"
         "the key is read from stdin or a file, never from the command line (every user of the host sees argv)")


def read_key(argv: list[str], stdin) -> str | None:
    """The API key, from ``--file PATH`` or stdin (its first line); None for anything else (a key in argv)."""
    if argv[:1] == ["--file"] and len(argv) == 2:
        text = Path(argv[1]).read_text()
    elif not argv:
        if stdin.isatty():
            import getpass

            return getpass.getpass("API key: ").strip() or None
        text = stdin.read()
    else:
        return None
    lines = text.splitlines()
    return lines[0].strip() if lines and lines[0].strip() else None


def main(argv: list[str]) -> int:
    key = read_key(argv, sys.stdin)
    if key is None:
        print(USAGE, file=sys.stderr)
        return 2
    print(json.dumps({"sha256": hash_key(key), "tenant": "CHANGE-ME", "max_priority": 9, "rpm": 600,
                      "max_queued": 100, "max_stored_bytes": "1GiB", "max_files": DEFAULT_MAX_FILES,
                      "weight": 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
