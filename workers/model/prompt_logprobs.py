"""Prompt logprobs: each prompt token's log-probability under the model, computed during the prefill.

The hidden state at position ``q`` gives the distribution of token ``q + 1``, so a prefill chunk over
positions ``[start, start + n)`` of a ``P``-token prompt scores tokens ``start + 1 .. min(start + n, P - 1)``
(the last prompt position's logits are the first output token's: sampled as usual).  A sequence that scores
its prompt takes nothing from the prefix cache (``Scheduler._admit``: a cached block holds K/V, not the
hidden states the logprobs come from), so every position is computed in order, chunk after chunk, and each
token is scored once (``Sequence.prompt_logprobs`` grows by a span per chunk).

The driver plans a step's spans from its sequences (``plan_spans``); the rank that samples scores them
(``score_spans``): the runner in one process, the last stage with pipeline stages (the plan travels in the
micro-batch's control message, as plain JSON).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedq.workers.engine.sequence import Sequence

# Rows whose logits are materialised at once: [rows, vocab] float32 (256 x 152k = 155 MB at most).
MAX_ROWS = 256

# A span: [request id, first row of the step, first position scored, the tokens scored, top-N].
Span = list


def plan_spans(ordered: list[tuple[Sequence, int]]) -> list[Span]:
    """The prompt tokens a step scores; ``ordered``: the step's (sequence, tokens) in row order."""
    spans: list[Span] = []
    row = 0
    for seq, n in ordered:
        scored = seq.prompt_logprobs
        if scored is not None:
            start = seq.num_computed_tokens
            first = max(start, len(scored) - 1)  # after a preemption a recomputed chunk is not scored again
            end = min(start + n, seq.num_prompt_tokens - 1)
            if first < end:
                spans.append([seq.request_id, row + first - start, first + 1, seq.token_ids[first + 1:end + 1],
                              seq.params.num_prompt_logprobs])
        row += n
    return spans


def score_spans(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                spans: list[Span]) -> list[list]:
    """``[request id, first position, entries]`` per span; an entry is ``{"token": [id, logprob, rank],
    "top": [[id, logprob], ...]}`` (rank 1 = the most likely token), from the model's raw distribution."""
    if not spans:
        return []
    device = hidden.device
    rows = torch.cat([torch.arange(s[1], s[1] + len(s[3])) for s in spans]).to(device)
    targets = torch.tensor([t for s in spans for t in s[3]], dtype=torch.long, device=device)
    k = max(s[4] for s in spans)
    lps, ranks, top_lps, top_ids = [], [], [], []
    for i in range(0, len(rows), MAX_ROWS):
        logprobs = compute_logits(hidden[rows[i:i + MAX_ROWS]]).float().log_softmax(dim=-1)
        lp = logprobs.gather(1, targets[i:i + MAX_ROWS, None])
        lps.append(lp[:, 0])
        ranks.append((logprobs > lp).sum(dim=1) + 1)
        if k:
            top = logprobs.topk(k, dim=-1)
            top_lps.append(top.values)
            top_ids.append(top.indices)
    lp_list = torch.cat(lps).tolist()
    rank_list = torch.cat(ranks).tolist()
    tops = list(zip(torch.cat(top_ids).tolist(), torch.cat(top_lps).tolist(), strict=True)) if k else []
    out, j = [], 0
    for request_id, _, position, tokens, num_top in spans:
        entries = []
        for token in tokens:
            top = list(zip(*tops[j], strict=True))[:num_top] if num_top else []
            entries.append({"token": [token, lp_list[j], rank_list[j]], "top": [list(t) for t in top]})
            j += 1
        out.append([request_id, position, entries])
    return out
