"""Greedy parity of replica layouts (stages x tensor-parallel shards) against one process, on any device.

    python scripts/check_parallel.py --layouts 2x1,3x1,1x2,2x2            # packaged model, CPU
    python scripts/check_parallel.py --model DIR --device cuda --dist-backend gloo

Prints, per layout, the share of prompts whose tokens equal the one-process
engine's and the generation time (a sanity check, not a benchmark).  Uses
random prompts of token ids, so it needs no data set.
"""

from __future__ import annotations

import argparse
import random
import time
import traceback

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.llm import LLM


def generate(settings: Settings, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    engine = LLM(settings)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return [o.output_token_ids for o in outs], time.perf_counter() - start
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dist-backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--layouts", default="2x1,1x2", help="STAGESxSHARDS, comma separated")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    base = dict(device=args.device, dist_backend=args.dist_backend, kv_cache_memory="256MiB", max_num_seqs=64,
                num_threads=args.threads, **({"model": args.model} if args.model else {}))
    rng = random.Random(0)
    settings = Settings(**base)
    vocab_size = LLM(settings).cfg.vocab_size
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(8, 120))] for _ in range(args.prompts)]
    reference, seconds = generate(settings, prompts, args.tokens)
    print(f"1x1: {seconds:.2f} s", flush=True)
    for layout in args.layouts.split(","):
        stages, shards = (int(x) for x in layout.split("x"))
        try:
            outs, seconds = generate(Settings(**base, pipeline_stages=stages, tensor_parallel=shards), prompts,
                                     args.tokens)
        except Exception:  # noqa: BLE001 - report and go on with the other layouts
            print(f"{layout}: FAILED\n{traceback.format_exc()}", flush=True)
            continue
        same = sum(a == b for a, b in zip(outs, reference, strict=True))
        print(f"{layout}: {seconds:.2f} s, identical to 1x1 on {same}/{len(prompts)} prompts", flush=True)


if __name__ == "__main__":
    main()
