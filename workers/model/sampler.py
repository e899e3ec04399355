"""Turn a batch of logits into next tokens, each row with its own SamplingParams.

Order: raw logprobs (reported as the model's own distribution), penalties,
``logit_bias``, the grammar mask of constrained rows (tokens their grammar does not allow go
to -inf), then greedy argmax or temperature / top-k / top-p / min-p sampling
over what is left.  Every transformation is a batched tensor operation over
the rows that need it; a batch without constrained rows never builds a mask.
Random sampling draws ``argmax(probs / E)`` with ``E ~ Exp(1)`` (the
Gumbel-max trick in another form); a seeded request draws its noise from its
own generator, so its tokens do not depend on its batch mates.
"""

from __future__ import annotations

import torch

from pagedq.workers.engine.executor import SamplerOutput
from pagedq.workers.engine.sequence import Sequence


def _rows(seqs: list[Sequence], predicate) -> torch.Tensor | None:
    idx = [i for i, s in enumerate(seqs) if predicate(s.params)]
    return torch.tensor(idx, dtype=torch.long) if idx else None


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: torch.Tensor) -> None:
    """Repetition (HF style, over prompt and output) and presence/frequency (OpenAI style, over output)."""
    vocab = logits.shape[1]
    sub = logits[rows]
    picked = [seqs[i] for i in rows.tolist()]
    out_counts = torch.zeros(len(picked), vocab, dtype=logits.dtype, device=logits.device)
    seen = torch.zeros(len(picked), vocab, dtype=torch.bool, device=logits.device)
    for r, s in enumerate(picked):  # only rows that asked for penalties
        out = torch.tensor(s.output_token_ids, dtype=torch.long)
        out_counts[r].index_add_(0, out, torch.ones(len(out), dtype=logits.dtype))
        seen[r, torch.tensor(s.token_ids, dtype=torch.long)] = True
    rep = torch.tensor([s.params.repetition_penalty for s in picked], dtype=logits.dtype)[:, None]
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    freq = torch.tensor([s.params.frequency_penalty for s in picked], dtype=logits.dtype)[:, None]
    pres = torch.tensor([s.params.presence_penalty for s in picked], dtype=logits.dtype)[:, None]
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)
    logits[rows] = sub


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Add each row's ``logit_bias`` to its tokens' logits (ids were checked against the vocabulary).

    The (ids, values) tensors are built once per sequence, at its first sampled token, and kept on it."""
    for i, s in enumerate(seqs):
        if s.params.logit_bias:
            if s.logit_bias_tensors is None or s.logit_bias_tensors[1].dtype != logits.dtype:
                s.logit_bias_tensors = (
                    torch.tensor(list(s.params.logit_bias), dtype=torch.long, device=logits.device),
                    torch.tensor(list(s.params.logit_bias.values()), dtype=logits.dtype, device=logits.device))
            ids, bias = s.logit_bias_tensors
            logits[i].index_add_(0, ids, bias)


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set to -inf each constrained row's tokens that its grammar does not allow next (rows without a grammar
    are not touched).  The bitmask is int32 ``[rows, ceil(vocab / 32)]``, token t = bit ``t % 32`` of word
    ``t // 32``, filled on the CPU by each sequence's grammar and applied by xgrammar's kernel.

    A greedy row whose best token the grammar allows is left as it is: the argmax of its masked row is that
    same token, and applying the mask (a pass over the whole vocabulary) is most of what a grammar costs."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr  # here: only a batch with a constrained sequence needs it

    vocab = logits.shape[1]
    bitmask = torch.full((len(seqs), (vocab + 31) // 32), -1, dtype=torch.int32)
    for i in rows:
        seqs[i].grammar.fill(bitmask, i, seqs[i].output_token_ids)
    greedy = [i for i in rows if seqs[i].params.greedy]
    if greedy:
        best = logits[greedy].argmax(dim=-1)
        allowed = (bitmask[greedy, best // 32] >> (best % 32)) & 1
        keep = {i for i, ok in zip(greedy, allowed.tolist(), strict=True) if ok}
        rows = [i for i in rows if i not in keep]
        if not rows:
            return
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows)


def apply_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top_k / top_p / min_p exclude; logits are temperature-scaled."""
    vocab = logits.shape[1]
    top_k = torch.tensor([min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
    min_p = torch.tensor([s.params.min_p for s in seqs], dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1])[None, :]
    probs = sorted_logits.softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop = (rank >= top_k[:, None]) | (cum_before >= top_p[:, None])
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the best token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
    """``logits [num_seqs, vocab]`` (float32) -> one token per sequence."""
    logits = logits.float()
    num_logprobs = [s.params.logprobs for s in seqs]
    raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in num_logprobs) else None

    penalty_rows = _rows(seqs, lambda p: p.needs_penalties)
    if penalty_rows is not None:
        apply_penalties(logits, seqs, penalty_rows)
    apply_logit_bias(logits, seqs)
    apply_grammar_masks(logits, seqs)

    tokens = logits.argmax(dim=-1)
    random_rows = _rows(seqs, lambda p: not p.greedy)
    if random_rows is not None:
        picked = [seqs[i] for i in random_rows.tolist()]
        temps = torch.tensor([s.params.temperature for s in picked], dtype=logits.dtype)[:, None]
        scaled = logits[random_rows] / temps
        if any(s.params.top_k > 0 or s.params.top_p < 1 or s.params.min_p > 0 for s in picked):
            scaled = apply_top_k_top_p_min_p(scaled, picked)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for r, s in enumerate(picked):
            if s.generator is not None:
                noise[r] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=s.generator)
        tokens[random_rows] = (probs / noise).argmax(dim=-1)

    token_list = tokens.tolist()
    logprobs: list[dict | None] = [None] * len(seqs)
    if raw_logprobs is not None:
        for i, n in enumerate(num_logprobs):
            if n is None:
                continue
            top = raw_logprobs[i].topk(n) if n > 0 else None
            logprobs[i] = {
                "token": (token_list[i], raw_logprobs[i, token_list[i]].item()),
                "top": list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else [],
            }
    return SamplerOutput(token_list, logprobs)
