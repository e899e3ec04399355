"""Token ids to text, stop strings, and streaming deltas (shared by engine and result consumer)."""

from __future__ import annotations


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string: (index, the stop string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def decode_output(tokenizer, token_ids: list[int], stops: list[str] = (), include_stop: bool = False
                  ) -> tuple[str, str | None]:
    """Text of generated tokens, cut at the first stop string: (text, matched stop or None)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hit = find_stop(text, list(stops))
    if hit is None:
        return text, None
    index, stop = hit
    return text[: index + len(stop) if include_stop else index], stop


def stable_prefix(text: str) -> str:
    """Drop a trailing replacement character: the rest of that character is still to come."""
    return text[:-1] if text.endswith("\ufffd") else text
