"""LLM: an engine built from Settings, with the tokenizer it needs around it.

The engine core (``pagedq.workers.engine``) knows token ids only.  ``LLM``
resolves the model's folder, loads the weights and the tokenizer, picks an
executor (this process, or a replica of pipeline stages x tensor-parallel
shards), and builds the ``LLMEngine`` over it.  Its ``generate`` runs
requests to completion with stop strings matched by one incremental
detokenizer per request (the core is told to finish a request when its stop
string appears).  Every other attribute is the engine's (``llm.step()``,
``llm.stats``, ``llm.scheduler``...).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pagedq.config import Settings, get_settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.config.served import engine_model_name
from pagedq.kernels import get_attention_backend
from pagedq.workers.detokenizer import IncrementalDetokenizer
from pagedq.workers.engine.executor import Executor
from pagedq.workers.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput, choice_ids
from pagedq.workers.grammar import GrammarBackend, GrammarState
from pagedq.workers.model.config import ModelConfig
from pagedq.workers.model.loader import resolve_model
from pagedq.workers.model.registry import build_model, cache_layout
from pagedq.workers.model.runner import LocalExecutor, ModelRunner, kv_cache_block_bytes, pick_device
from pagedq.workers.model.weights import load_weights
from pagedq.workers.parallel.distributed import ParallelConfig

log = logging.getLogger(__name__)


def fingerprint_weights(weights: dict[str, torch.Tensor]) -> str:
    """Hash of every weight's name, shape, dtype and bytes: different weights, different fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().data)
    return h.hexdigest()


@dataclass
class Generation:
    """A finished request as ``LLM.generate`` returns it: the engine's output and its text."""

    output: RequestOutput
    text: str
    others: list[Generation] = field(default_factory=list)  # choices 1.. of a request with n > 1

    def __getattr__(self, name: str):
        return getattr(self.output, name)


class LLM:
    def __init__(self, settings: Settings | None = None, model: str | None = None) -> None:
        s = self.settings = settings or get_settings()
        if s.num_threads:
            torch.set_num_threads(s.num_threads)
        source = resolve_model(model or s.model, s.state_dir)
        source = replace(source, name=engine_model_name(s, source.name))  # PAGEDQ_SERVED_MODEL_NAME's first
        self.model_path = source.path
        self.cfg = ModelConfig.from_folder(source.path)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(source.path)
        self.device = pick_device(s.device)
        self.dtype = getattr(torch, s.dtype)
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        weights = load_weights(source.path)
        fingerprint = fingerprint_weights(weights)
        config = EngineConfig(
            model_name=source.name, fingerprint=fingerprint,
            max_model_len=min(s.max_model_len or self.cfg.max_position_embeddings,
                              self.cfg.max_position_embeddings, self.cfg.sliding_window or 1 << 30),
            vocab_size=self.cfg.vocab_size, eos_token_ids=frozenset(eos), block_size=s.block_size,
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            scheduling_policy=s.scheduling_policy, enable_prefix_caching=s.enable_prefix_caching,
            kv_windows=cache_layout(self.cfg).windows)
        self.engine = LLMEngine(config, self._executor(source.name, weights))
        self._grammar_backend: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()
        reason = grammar_unsupported(s)
        if reason is None:
            self.engine.new_grammar = self.new_grammar
        else:
            self.engine.no_grammar_reason = reason
        log.info("engine ready: %s (%s), %d KV blocks x %d tokens, %d stage(s) x %d shard(s)", source.name,
                 fingerprint[:12], self.engine.block_manager.num_blocks, s.block_size, s.pipeline_stages,
                 s.tensor_parallel)

    def _executor(self, model_name: str, weights: dict[str, torch.Tensor]) -> Executor:
        s = self.settings
        if ParallelConfig(s.pipeline_stages, s.tensor_parallel).is_distributed:
            from pagedq.workers.parallel.executor import PipelineExecutor

            return PipelineExecutor.start(self.cfg, weights, model_name, s, self.device, self.dtype)
        attention = get_attention_backend(s.attention_backend, self.device)
        model = build_model(self.cfg, weights, device=self.device, dtype=self.dtype, attention=attention)
        _, tensors = cache_layout(self.cfg).stage_slots(0, self.cfg.num_layers)
        num_blocks = s.num_kv_blocks or s.kv_cache_memory // kv_cache_block_bytes(
            self.cfg, tensors, s.block_size, self.dtype)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={s.kv_cache_memory} holds fewer than 2 blocks")
        return LocalExecutor(ModelRunner(model, num_blocks, s.block_size, self.device, self.dtype))

    def new_grammar(self, constraint: list[str]) -> GrammarState:
        """A sequence's grammar state; the backend (xgrammar, the tokenizer's vocabulary) is built on first use."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                self._grammar_backend = GrammarBackend(self.tokenizer, self.cfg.vocab_size,
                                                       self.engine.config.eos_token_ids)
        return self._grammar_backend.new_state(constraint)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["engine"], name)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 priorities: list[int] | None = None, on_step=None) -> list[Generation]:
        """Run prompts to completion; results in input order.  ``on_step(finished ids)`` after each step."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        detoks = {cid: IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output)
                  for rid, p in zip(ids, params_list, strict=True) for cid in [rid, *choice_ids(rid, p.n)]}
        # Each constrained request gets its own grammar state, compiled here before the first step (the
        # compiler caches by schema, so a batch of one schema compiles it once).
        grammars = [self.engine.grammar_for(p) for p in params_list]
        for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            self.engine.add_request(rid, prompt, params_list[i], priorities[i] if priorities else 0,
                                    grammar=grammars[i])
        finished: dict[str, Generation] = {}
        while len(finished) < len(detoks):
            for out in self.engine.step():
                detok = detoks[out.request_id]
                if detok.stop:
                    feed(detok, out, self.engine)
                if out.finished:
                    finished[out.request_id] = finish(detok, out)
            if on_step:
                on_step({rid: finished[rid] for rid in ids if rid in finished})
        for rid, p in zip(ids, params_list, strict=True):
            finished[rid].others = [finished[cid] for cid in choice_ids(rid, p.n)]
        return [finished[rid] for rid in ids]

    def reload_weights(self, path: str | Path | None = None) -> str:
        """Load the weights again (changed files, or another folder of the same architecture).

        The prefix cache starts empty; requests in flight keep their tokens and are recomputed
        with the new weights.  Returns the new fingerprint.
        """
        if not isinstance(self.engine.executor, LocalExecutor):
            raise NotImplementedError("reload_weights with pipeline stages or tensor parallelism")
        if path is not None:
            self.model_path = Path(path)
        weights = load_weights(self.model_path)
        fingerprint = fingerprint_weights(weights)
        self.engine.replace_executor(self._executor(self.engine.model_name, weights), fingerprint)
        return fingerprint


def grammar_unsupported(settings: Settings) -> str | None:
    """Why an engine built from ``settings`` cannot constrain outputs, or None when it can."""
    if ParallelConfig(settings.pipeline_stages, settings.tensor_parallel).is_distributed:
        # The last stage samples with its own copies of the sequences, which carry no grammar state.
        return ("structured outputs are not supported with pipeline_stages > 1 or tensor_parallel > 1 yet; "
                "serve the model in one process")
    return None


def feed(detok: IncrementalDetokenizer, out: RequestOutput, engine: LLMEngine) -> None:
    """Detokenize a request's new tokens; a stop string that appears finishes it in the engine."""
    if detok.stopped is None and detok.update(out.output_token_ids[len(detok.token_ids):]) and not out.finished:
        engine.finish_request(out.request_id, "stop", detok.stopped)


def finish(detok: IncrementalDetokenizer, out: RequestOutput) -> Generation:
    """A finished request's final text and output, cut at its stop string if one matched."""
    if detok.stopped is None:
        detok.update(out.output_token_ids[len(detok.token_ids):])
    if detok.stopped is not None:
        n = detok.num_tokens_at_stop
        out.output_token_ids = out.output_token_ids[:n]
        out.logprobs = out.logprobs[:n]
        out.finish_reason, out.stop_reason = "stop", detok.stopped
    return Generation(out, detok.finish())
