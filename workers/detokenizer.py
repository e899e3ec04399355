"""Incremental detokenization: one per request, each token decoded about once.

``update(new_token_ids)`` turns new tokens into text by decoding only a small
window (the last few tokens before them, whose text is subtracted), so a
request of n tokens costs O(n) decoding, not O(n^2).  It then looks for stop
strings in the new text only (plus the last ``len(stop) - 1`` characters
before it, where a stop string may have begun).  Once a stop string matches,
the text is cut there and further tokens are ignored.

``delta()`` hands out text not yet handed out, holding back what could still
become a stop string and a trailing half-decoded character, so streamed
pieces always join to ``text``.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence at or after ``start`` of any stop string: (index, the stop string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars a stop string may still need
        self.token_ids: list[int] = []
        self.text = ""  # decoded text, cut at the stop string once one matched
        self.stopped: str | None = None  # the stop string that matched
        self.num_tokens_at_stop: int | None = None  # output tokens up to the one that completed it
        self._prefix_offset = 0  # token_ids[prefix_offset:read_offset] is context already in ``text``
        self._read_offset = 0
        self._streamed = 0  # chars of ``text`` handed out by delta()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add generated tokens; returns the stop string if one matched now."""
        if self.stopped is not None:
            return None
        if not self.stop:  # no position to find: decode the new tokens as one window
            self.token_ids.extend(new_token_ids)
            self._decode_next()
            return None
        for token in new_token_ids:
            self.token_ids.append(token)
            before = len(self.text)
            self._decode_next()
            if self.stop and len(self.text) > before:
                hit = find_stop(self.text, self.stop, max(0, before - self.hold))
                if hit is not None:
                    index, stop = hit
                    self.text = self.text[: index + len(stop) if self.include_stop else index]
                    self.stopped, self.num_tokens_at_stop = stop, len(self.token_ids)
                    return stop
        return None

    def _decode_next(self) -> None:
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        # else: a character is still incomplete; the next token completes it

    def finish(self) -> str:
        """The final text: whatever an incomplete character left undecoded is flushed."""
        if self.stopped is None and self._read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
            self.text += self._decode(self.token_ids[self._prefix_offset:])[len(prefix):]
            self._prefix_offset = self._read_offset = len(self.token_ids)
        return self.text

    def delta(self, finished: bool = False) -> str:
        """Text not handed out yet; before the end, minus what could still turn into a stop string."""
        if finished:
            self.finish()
            end = len(self.text)
        else:
            end = len(self.text) if self.stopped is not None else max(len(self.text) - self.hold, 0)
        piece = self.text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return piece
