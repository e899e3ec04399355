"""``pagedq run-batch --offline``: an OpenAI Batch file through one in-process engine.

Each input line is parsed and checked on its own; a bad line becomes an error
line in the output, the others still run.  Output lines keep input order.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedq.config import Settings
from pagedq.config.messages import ChoiceOutput, PromptScores
from pagedq.config.served import served_names
from pagedq.pipeline.postprocess import Completion, batch_output_line, build_response
from pagedq.pipeline.preprocess import render_prompt
from pagedq.pipeline.protocol import (
    AnyRequest,
    RequestError,
    parse_batch_line,
    read_batch_file,
    to_sampling_params,
)


@dataclass
class PreparedLine:
    custom_id: str
    request: AnyRequest
    prompt_ids: list[int]


def _check_model(req: AnyRequest, served: str, aliases: list[str]) -> None:
    if req.model not in (None, served, *aliases):
        raise RequestError(f"model: unknown model {req.model!r}; this engine serves {served!r}", "model",
                           code="model_not_found")


def prepare_lines(lines: list[str], engine) -> list[PreparedLine | dict]:
    """Each line becomes a PreparedLine or, if it is bad, its finished error line."""
    prepared: list[PreparedLine | dict] = []
    for line in lines:
        custom_id = None
        try:
            custom_id, req, _ = parse_batch_line(line)
            _check_model(req, engine.model_name, served_names(engine.settings))
            ids = render_prompt(engine.tokenizer, req)
            engine.validate(ids, to_sampling_params(req))  # context length, vocabulary, KV capacity
            prepared.append(PreparedLine(custom_id, req, ids))
        except RequestError as e:
            prepared.append(batch_output_line(getattr(e, "custom_id", None) or custom_id, error=e))
    return prepared


def run_offline(input_path: Path, output_path: Path, settings: Settings, model: str | None = None,
                progress: bool = True) -> dict:
    from pagedq.workers.llm import LLM

    engine = LLM(settings, model)
    try:
        return _run(engine, input_path, output_path, progress)
    finally:
        engine.shutdown()  # stops the stage processes of a pipelined engine


def _run(engine, input_path: Path, output_path: Path, progress: bool) -> dict:
    from tqdm import tqdm

    lines = read_batch_file(input_path)
    prepared = prepare_lines(lines, engine)
    jobs = [(i, p) for i, p in enumerate(prepared) if isinstance(p, PreparedLine)]
    bar = tqdm(total=len(jobs), desc="requests", unit="req", file=sys.stderr, disable=not progress)
    done = 0

    def on_step(finished: dict) -> None:
        nonlocal done
        bar.update(len(finished) - done)
        done = len(finished)

    outs = engine.generate([p.prompt_ids for _, p in jobs], [to_sampling_params(p.request) for _, p in jobs],
                           priorities=[p.request.priority for _, p in jobs], on_step=on_step) if jobs else []
    bar.close()
    for (i, p), out in zip(jobs, outs, strict=True):
        failed = next((o for o in [out, *out.others] if o.finish_reason == "error"), None)
        if failed is not None:
            error = RequestError(f"the engine failed on this request: {failed.error}", code="engine_error")
            prepared[i] = batch_output_line(p.custom_id, error=error)
            continue
        kind = "chat" if hasattr(p.request, "messages") else "text"
        completion = Completion(
            request_id=p.custom_id, kind=kind, model=engine.model_name, text=out.text,
            output_token_ids=out.output_token_ids, num_prompt_tokens=out.num_prompt_tokens,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason, num_cached_tokens=out.num_cached_tokens,
            logprobs=out.logprobs, want_logprobs=p.request.num_logprobs,
            tool_parsing=getattr(p.request, "tool_parsing", ""), others=[ChoiceOutput.of(o) for o in out.others],
            prompt=PromptScores.of(to_sampling_params(p.request), p.prompt_ids, out.prompt_logprobs))
        prepared[i] = batch_output_line(p.custom_id, build_response(completion, engine.tokenizer))
    with open(output_path, "w") as f:
        for item in prepared:
            f.write(json.dumps(item) + "\n")
    return {"lines": len(lines), "completed": len(jobs), "failed": len(lines) - len(jobs),
            "stats": engine.stats.as_dict()}
