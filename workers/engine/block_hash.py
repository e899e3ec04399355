"""The prefix cache's block names, defined once: the engine's ``BlockManager`` names its blocks with them, and the
CPU side (which has a prompt's token ids before generation) computes the same names to ask which worker holds
a prompt's prefix (issue 20: cache-aware placement).

A full block of ``block_size`` tokens is named by a hash chain: blake2b-16 over the parent block's name (the
cache key for the first block: the model and its weights' fingerprint, so two models or two weights never
share a name, and the request's ``cache_salt``, so two tenants' prompts never do) and the block's own token
ids.  Plain Python (no torch): the CPU worker imports it.
"""

from __future__ import annotations

import hashlib


def cache_key(model_name: str, fingerprint: str, cache_salt: str = "") -> str:
    """What the first block's hash starts from: the model and the weights that computed the cache, and the
    request's ``cache_salt`` (``salted``)."""
    return salted(f"{model_name}:{fingerprint}", cache_salt)


def salted(key: str, cache_salt: str) -> str:
    """``key`` for a request with ``cache_salt``: blocks of requests with different salts never share a name
    (a tenant cannot learn from ``cached_tokens`` what another tenant sent); "" leaves the key as it is."""
    return f"{key}\n{cache_salt}" if cache_salt else key


def hash_block(parent: bytes | None, token_ids: list[int], key: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or key.encode())
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: list[int], num_tokens: int, block_size: int, key: str) -> None:
    """Extend ``hashes`` (the names of the first ``len(hashes)`` blocks) over the full blocks among the first
    ``num_tokens`` of ``token_ids``."""
    for i in range(len(hashes), num_tokens // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size], key))


def prefix_hashes(token_ids: list[int], block_size: int, key: str, limit: int | None = None) -> list[bytes]:
    """The names of the blocks a prompt could find cached: its full blocks among all but its last token (a
    step must compute at least one token to have logits; ``BlockManager.find_cached_prefix``), at most
    ``limit`` of them."""
    num_tokens = len(token_ids) - 1
    if limit is not None:
        num_tokens = min(num_tokens, limit * block_size)
    hashes: list[bytes] = []
    extend_hashes(hashes, token_ids, max(num_tokens, 0), block_size, key)
    return hashes
