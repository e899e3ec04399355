"""Grammar-constrained decoding with xgrammar: compiled grammars, and each sequence's place in its grammar.

- ``GrammarBackend`` (one per engine) compiles a constraint (``[kind, text]``,
  ``pagedq.config.constraints``) against the model's tokenizer into a token
  automaton.  ``compile`` may be called from any thread and releases the GIL:
  callers compile on their own thread (the Celery task thread, or before
  ``add_request``), never on the engine's stepping thread, so a slow schema
  does not stall the batch.  Compiled grammars are cached (LRU, bounded in
  bytes) by the exact constraint text, which the request schema canonicalises.
  A compile runs on a daemon thread of its own, at most two at once, and is
  given ``compile_timeout_s`` (10 s, waiting for a slot included): past it the
  request fails (a RequestError naming ``response_format``); the compile itself
  cannot be stopped, finishes in the background and never holds up an exit.
- ``GrammarState`` (one per ``Sequence``) wraps a ``GrammarMatcher``.  It is
  used by the stepping thread only (the sampler calls ``fill``).

Invariant of ``GrammarState``: when ``fill`` writes a mask, the matcher has
accepted exactly the sequence's output tokens.  It resyncs lazily from
``output_token_ids`` (accepting what is new, rolling back what is gone), so
preemption, recompute, a failed step or a reload need no hook: none of them
changes the tokens, or if a later feature removes some, the rollback covers it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from pagedq.config.constraints import grammar_source


class GrammarError(RuntimeError):
    """A sampled token the grammar does not allow (cannot happen once its mask applied): fails the request."""


GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_threads: int = 1,
                 cache_limit_bytes: int = 64 << 20, compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S) -> None:
        """``vocab_size`` is the logits' width (the model's lm_head rows, which can exceed ``len(tokenizer)``);
        ``stop_token_ids`` are every id the engine stops on, the only ones allowed once the grammar is complete."""
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True,
                                            cache_limit_bytes=cache_limit_bytes)
        self.compile_timeout_s = compile_timeout_s
        self._slots = threading.BoundedSemaphore(2)

    def compile(self, constraint: list[str]):
        """The ``CompiledGrammar`` of a constraint (raises ValueError / RuntimeError when it does not compile,
        TimeoutError when it takes longer than ``compile_timeout_s``)."""
        late = TimeoutError(f"not compiled within {self.compile_timeout_s:g} s")
        if not self._slots.acquire(timeout=self.compile_timeout_s):
            raise late
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(self._compile(constraint))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                done.set_exception(e)
            finally:
                self._slots.release()

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        try:
            return done.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise late from None

    def _compile(self, constraint: list[str]):
        src = grammar_source(constraint)
        if src.method == "json_schema":
            return self.compiler.compile_json_schema(src.text, any_whitespace=src.any_whitespace,
                                                     separators=src.separators, strict_mode=src.strict)
        if src.method == "regex":
            return self.compiler.compile_regex(src.text)
        return self.compiler.compile_grammar(src.text)

    def new_state(self, constraint: list[str]) -> GrammarState:
        """A fresh matcher for one sequence (compiles, or takes the cached grammar)."""
        return GrammarState(self._xgr.GrammarMatcher(self.compile(constraint)))


class GrammarState:
    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.accepted: list[int] = []  # the output tokens the matcher has accepted, in order

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to exactly ``output_token_ids`` (rollback to the common prefix, then accept)."""
        n = len(self.accepted)
        if output_token_ids[:n] != self.accepted:  # tokens were taken back: rewind to what both share
            keep = _common_prefix(self.accepted, output_token_ids)
            self.matcher.rollback(n - keep)
            del self.accepted[keep:]
        for token in output_token_ids[len(self.accepted):]:
            if not self.matcher.accept_token(token):
                raise GrammarError(f"token {token} does not fit the grammar after {len(self.accepted)} tokens")
            self.accepted.append(token)

    def fill(self, bitmask: torch.Tensor, row: int, output_token_ids: list[int]) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit ``t % 32`` of word ``t // 32``)."""
        self.sync(output_token_ids)
        self.matcher.fill_next_token_bitmask(bitmask, row)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
