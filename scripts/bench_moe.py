"""Mixture-of-experts speed, side by side: pagedq on a random Qwen3-MoE vs transformers and vs a dense twin.

Two random models are built here with transformers, at run time in a
temporary folder (never committed), in the default model's shape (its
config.json: hidden size, layers, heads, KV heads, head size, vocabulary,
tied embeddings, RoPE, norm epsilon) and with its tokenizer and chat template:

* MoE: a ``Qwen3MoeConfig`` with 8 experts, top-2 (``norm_topk_prob``), every
  layer sparse, each expert half the default's MLP width, so the two active
  experts are as wide as the default's one MLP;
* dense: a ``Qwen3Config`` of the same shape with the default's MLP width,
  i.e. the MoE's active size.

Weights are random (a fresh seed each run unless ``--model-seed``; printed).
Requests are sampled from ShareGPT exactly as ``bench_throughput.py`` does
(fixed seed; prompt = first human turn, chat-templated; output length = token
length of the first reply, capped; ignore_eos; all submitted at once).  In
this one process, one after the other: pagedq's engine on the MoE, pagedq's
engine on the dense model, Hugging Face ``generate`` with static batches on
the MoE.  Reported: pagedq MoE output tok/s / HF MoE output tok/s (the bar:
>= 3x) and pagedq MoE seconds / pagedq dense seconds (the bar: <= 1.5x).  It
measures and asserts nothing; it exits 0.

    python scripts/bench_moe.py                         # 200 requests, all three runs
    python scripts/bench_moe.py --hf-requests 64        # shorter HF side (ratio of output tok/s rates)
    python scripts/bench_moe.py --num-requests 8 --hf-requests 8 --max-output-len 16   # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from bench_throughput import LoadMeter, Result, run_engine, run_hf
from sharegpt import sample_requests

from pagedq.config import Settings
from pagedq.workers.model.loader import resolve_model

NUM_EXPERTS, TOP_K = 8, 2


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def shape_of(default: dict) -> dict:
    """The default model's shape, as keyword arguments that Qwen3Config and Qwen3MoeConfig share."""
    heads = default["num_attention_heads"]
    rope = default.get("rope_parameters") or {"rope_type": "default", "rope_theta": default.get("rope_theta", 10_000.0)}
    return dict(vocab_size=default["vocab_size"], hidden_size=default["hidden_size"],
                num_hidden_layers=default["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=default.get("num_key_value_heads", heads),
                head_dim=default.get("head_dim", default["hidden_size"] // heads),
                hidden_act=default.get("hidden_act", "silu"),
                max_position_embeddings=default["max_position_embeddings"],
                initializer_range=default.get("initializer_range", 0.02),
                rms_norm_eps=default.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=default.get("tie_word_embeddings", False), rope_parameters=rope,
                bos_token_id=default.get("bos_token_id"), eos_token_id=default.get("eos_token_id"),
                pad_token_id=default.get("pad_token_id"))


def param_counts(model: torch.nn.Module, num_experts: int = 1, top_k: int = 1) -> tuple[int, int]:
    """(total, active per token): expert weights count top_k / num_experts of theirs as active."""
    total = expert = 0
    for name, p in model.named_parameters():  # tied embeddings once
        total += p.numel()
        if ".experts." in name:
            expert += p.numel()
    return total, total - expert + expert * top_k // num_experts


def build(kind: str, default: dict, folder: Path, tokenizer, seed: int) -> str:
    """Save a random model of ``kind`` ('moe' or 'dense') with the default tokenizer; a line describing it."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    shape = shape_of(default)
    if kind == "moe":
        cfg = Qwen3MoeConfig(**shape, intermediate_size=default["intermediate_size"],
                             moe_intermediate_size=default["intermediate_size"] // TOP_K, num_experts=NUM_EXPERTS,
                             num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg = Qwen3Config(**shape, intermediate_size=default["intermediate_size"])
    torch.manual_seed(seed)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    total, active = param_counts(model, NUM_EXPERTS, TOP_K) if kind == "moe" else param_counts(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # the default's tokenizer and chat template
    del model
    gc.collect()
    desc = (f"{NUM_EXPERTS} experts x {cfg.moe_intermediate_size} wide, top-{TOP_K}" if kind == "moe"
            else f"MLP {cfg.intermediate_size} wide")
    return (f"{kind:5s} {cfg.architectures[0] if cfg.architectures else type(cfg).__name__}: {desc}; "
            f"{total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token "
            f"(built and saved in {time.perf_counter() - start:.0f}s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT sampling seed")
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--hf-requests", type=int, default=None, help="run HF on only the first N requests")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model-seed", type=int, default=None, help="seed of the random weights (default: a fresh one)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    settings = Settings()
    default_path = resolve_model(None, settings.state_dir).path
    default = json.loads((default_path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(default_path)
    model_seed = args.model_seed if args.model_seed is not None else random.SystemRandom().randrange(2**31)
    print(f"CPU: {cpu_name()}; torch threads={torch.get_num_threads()}; "
          f"shape of {default_path.name}; weight seed={model_seed}", flush=True)

    requests = sample_requests(tokenizer, args.num_requests, args.seed, args.max_prompt_len, args.max_output_len)
    print(f"{len(requests)} requests: {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens", flush=True)

    with tempfile.TemporaryDirectory(prefix="pagedq-bench-moe-") as scratch:
        moe_path, dense_path = Path(scratch) / "moe", Path(scratch) / "dense"
        models = {"moe": build("moe", default, moe_path, tokenizer, model_seed),
                  "dense": build("dense", default, dense_path, tokenizer, model_seed)}
        for line in models.values():
            print(line, flush=True)

        results: list[Result] = []
        for name, path in (("pagedq engine, MoE", moe_path), ("pagedq engine, dense", dense_path)):
            results.append(run_engine(settings.model_copy(update={"model": str(path)}), requests, name))
            print(results[-1].row(), flush=True)
            gc.collect()  # one process: nothing to shut down; the engine is dropped on return
        if not args.skip_hf:
            hf_reqs = requests[: args.hf_requests] if args.hf_requests else requests
            meter = LoadMeter()
            hf = run_hf(moe_path, tokenizer, hf_reqs, args.hf_batch_size)
            hf.name, hf.extra = f"{hf.name}, MoE", f"{meter.read()} (model load included)"
            results.append(hf)
            print(results[-1].row(), flush=True)
            gc.collect()

    moe, dense = results[0], results[1]
    print(f"\nCPU: {cpu_name()}, torch threads={torch.get_num_threads()}; weight seed={model_seed}")
    for line in models.values():
        print(line)
    print("\n| system | requests | seconds | requests/s | output tok/s | total tok/s | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(r.row())
    ratios: dict[str, float] = {"moe_over_dense_seconds": moe.seconds / dense.seconds}
    print()
    if not args.skip_hf:
        hf = results[2]
        ratios["pagedq_over_hf_output_tps"] = moe.output_tps / hf.output_tps
        note = (f" (HF ran only the first {hf.num_requests} of {moe.num_requests} requests: "
                "this compares output-token rates, not wall times)" if hf.num_requests < moe.num_requests else "")
        print(f"output tok/s, pagedq engine / HF static batching, same MoE model: "
              f"{ratios['pagedq_over_hf_output_tps']:.2f}x (bar: >= 3x){note}")
    print(f"seconds, pagedq MoE / pagedq dense of the same active size: "
          f"{ratios['moe_over_dense_seconds']:.2f}x (bar: <= 1.5x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "weight_seed": model_seed,
                       "models": models, "runs": [r.__dict__ for r in results], "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
