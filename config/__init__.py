"""Settings shared by every pagedq component."""

from pagedq.config.settings import DEFAULT_MODEL, Settings, get_settings, parse_bytes

__all__ = ["DEFAULT_MODEL", "Settings", "get_settings", "parse_bytes"]
