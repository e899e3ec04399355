"""What lives in Redis: job records and their Lua state changes, the registry, the result cache, the hardened transport."""
