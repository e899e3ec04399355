"""The incremental detokenizer against a real byte-level BPE tokenizer trained here (no model files).

Its text must equal decoding all tokens at once; stop strings must cut the text
where a full decode would; streamed deltas must join to the final text; and a
long request must cost linear decoding work.
"""

from __future__ import annotations

import functools
import random

import pytest

from pagedq.workers.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Paged attention keeps the KV cache in fixed-size blocks; ",
    "naïve café déjà vu — 東京 🚀 emoji and accents, ",
    "def f(x):\n    return x * 2\n\n",
    "STOP here. END of story!! ###\n",
]


@functools.lru_cache(maxsize=1)
def tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 50, vocab_size=400, min_frequency=1, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decoded_tokens = 0
        self.calls = 0

    def decode(self, ids, **kw) -> str:
        self.calls += 1
        self.decoded_tokens += len(ids)
        return self.inner.decode(ids, **kw)


def random_ids(n: int, seed: int) -> list[int]:
    """Token ids of random corpus text (so multi-byte characters split across tokens occur)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer().encode(rng.choice(CORPUS), add_special_tokens=False)
    return ids[:n]


def feed_in_chunks(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        detok.update(ids[i:i + n])
        i += n
        deltas.append(detok.delta())
    deltas.append(detok.delta(finished=True))
    return deltas


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(5)])
def test_text_and_deltas_equal_a_full_decode(seed):
    ids = random_ids(300, seed)
    detok = IncrementalDetokenizer(tokenizer())
    deltas = feed_in_chunks(detok, ids, random.Random(seed))
    full = tokenizer().decode(ids, skip_special_tokens=True)
    assert detok.finish() == full
    assert "".join(deltas) == full


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(5)])
def test_stop_string_cuts_where_a_full_decode_does(seed):
    rng = random.Random(seed)
    ids = random_ids(400, seed)
    full = tokenizer().decode(ids, skip_special_tokens=True)
    stop = rng.choice(["END", "fox jumps", "東京", "\n\n", "!! #"])
    assert stop in full, "the corpus should contain every stop string"
    detok = IncrementalDetokenizer(tokenizer(), [stop, "never-in-the-text"])
    deltas = feed_in_chunks(detok, ids, rng)
    assert detok.stopped == stop
    assert detok.text == full[: full.index(stop)]
    assert "".join(deltas) == detok.text, "nothing past the stop string was streamed"
    # The stop string was complete after exactly num_tokens_at_stop tokens, and not before.
    n = detok.num_tokens_at_stop
    assert stop in tokenizer().decode(ids[:n]) and stop not in tokenizer().decode(ids[:n - 1])


def test_include_stop_str_in_output_keeps_it():
    ids = random_ids(200, 7)
    detok = IncrementalDetokenizer(tokenizer(), ["lazy"], include_stop_str_in_output=True)
    detok.update(ids)
    full = tokenizer().decode(ids)
    assert detok.text == full[: full.index("lazy") + len("lazy")]


def decode_cost(n: int, stop: list[str]) -> int:
    counting = CountingTokenizer(tokenizer())
    detok = IncrementalDetokenizer(counting, stop)
    for token in random_ids(n, 3):  # one token per step, as the engine produces them
        detok.update([token])
        detok.delta()
    detok.finish()
    return counting.decoded_tokens


def test_cost_is_linear_in_output_length():
    stop = ["this stop string never appears"]
    short, long = decode_cost(1000, stop), decode_cost(2000, stop)
    print(f"token ids decoded: {short} for 1000 tokens, {long} for 2000 ({long / short:.2f}x)")
    assert long <= 2.2 * short, "doubling the output should about double the decoding work"
    assert long <= 8 * 2000, "each token is decoded a bounded number of times"
    # What the old per-step full decode cost: n(n+1)/2 token ids.
    assert long < 2000 * 2001 // 2 / 50
