"""A hostile tenant against a victim tenant, measured (issue 48).

    python scripts/hostile_tenant.py                          # every scenario; prints one table
    python scripts/hostile_tenant.py replay regex --seconds 20

Starts a deployment (``Stack``: redis-server, a GPU and a CPU worker; the model of ``PAGEDQ_MODEL``, else the
default) and ``pagedq serve`` with a keys file of two tenants: A (hostile) and B (the victim).  B streams
24-token greedy chats, one every 2 s, all the time; its time to first token (TTFT) is measured alone first,
then while A runs each scenario:

- ``unknown_model_batch``: a 50,000-line batch naming a model nobody serves;
- ``stop_logit``: chats and a batch whose lines carry the most ``stop_token_ids`` (64) and ``logit_bias``
  entries (300) allowed, and one over each bound;
- ``n128``: ``n`` 128 with ``top_logprobs`` 20 and the longest output the budget allows, and one over it;
- ``uploads``: 20 concurrent 64 MiB uploads;
- ``regex``: a pathological regex and a JSON-schema ``pattern`` (refused), and a long legal one;
- ``cancel_storm``: a 5,000-line batch cancelled 200 times from 8 threads;
- ``big_batch``: the same 5,000-line batch, not cancelled (not in the default list: it tells the batch's
  creation from the cancels in ``cancel_storm``'s figure);
- ``replay``: B's own greedy prompts sent again by A.

Columns: B's TTFT p90 (and its ratio to B alone: at most 2x is the bar), A's requests by outcome (2xx; 4xx
with the field the error names; 5xx; errors), Redis used memory at its peak (against ``maxmemory``), and A's
answers showing B's caches (``cached``, or ``cached_tokens`` beyond A's own chat-template prefix).  API keys
are made here and never leave this process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedq.config import Settings
from pagedq.pipeline.gateway.keys import hash_key
from pagedq.pipeline.local.stack import Stack, settings_env
from pagedq.pipeline.protocol import MAX_LOGIT_BIAS, MAX_OUTPUT_BUDGET, MAX_STOP_TOKEN_IDS
from pagedq.store.connection import redis_client
from pagedq.workers.processes import free_port, spawn, stop

CHAT = "/v1/chat/completions"
VICTIM_EVERY_S = 2.0
VICTIM_TOKENS = 24
WORDS = ("river stone lantern orchard copper meadow harbor violet thunder cedar quartz ember falcon granite "
         "willow sapphire tundra cobalt juniper").split()


def phrase(n: int) -> str:
    return " ".join(random.choice(WORDS) for _ in range(n))


def victim_prompt() -> str:
    """A prompt that shares nothing with any other past the chat template (its first word is its own), so
    whatever more than the template one finds cached was sent before with these very words."""
    return f"{secrets.token_hex(4)}: write a short poem about {phrase(8)}."


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


@dataclass
class Outcomes:
    """What A's requests got: 2xx, 4xx by the field named, 5xx, errors."""

    counts: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, reply: httpx.Response | Exception) -> httpx.Response | None:
        if isinstance(reply, Exception):
            key = f"error {type(reply).__name__}"
        elif reply.status_code < 300:
            key = "2xx"
        elif reply.status_code < 500:
            try:
                err = reply.json()["error"]
                key = f"{reply.status_code} {err.get('param') or err.get('code')}"
            except (ValueError, KeyError, TypeError):
                key = str(reply.status_code)
        else:
            key = str(reply.status_code)
        with self.lock:
            self.counts[key] += 1
        return None if isinstance(reply, Exception) else reply

    def text(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))


class Victim:
    """Tenant B, in a process of its own (A's client threads never share its interpreter): a streamed 24-token
    greedy chat every 2 s; the TTFT of each, and its prompts (for ``replay``)."""

    def __init__(self, base: str, key: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # not a fork of a process with threads
        self.results = ctx.Queue()
        self.halt = ctx.Event()
        self.proc = ctx.Process(target=_victim, args=(base, key, self.results, self.halt), daemon=True)
        self.ttfts: list[tuple[float, float]] = []  # (started at, seconds to the first token)
        self._prompts: list[str] = []
        self.failures = 0

    def start(self) -> None:
        self.proc.start()

    def stop(self) -> None:
        self.halt.set()
        self.proc.join(30)

    def _drain(self) -> None:
        while True:
            try:
                start, took, prompt = self.results.get_nowait()
            except queue.Empty:
                return
            if took is None:
                self.failures += 1
            else:
                self.ttfts.append((start, took))
                self._prompts.append(prompt)

    @property
    def prompts(self) -> list[str]:
        self._drain()
        return list(self._prompts)

    def p90_since(self, t0: float, t1: float) -> tuple[float, int]:
        self._drain()
        took = [d for s, d in self.ttfts if t0 <= s <= t1]
        return pct(took, 0.9), len(took)


def _victim(base: str, key: str, results, halt) -> None:
    def one() -> None:
        prompt = victim_prompt()
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": VICTIM_TOKENS, "temperature": 0,
                "stream": True}
        start = time.monotonic()  # the system's monotonic clock: the same in both processes
        try:
            with httpx.stream("POST", base + CHAT, json=body, timeout=600,
                              headers={"Authorization": f"Bearer {key}"}) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        results.put((start, time.monotonic() - start, prompt))
                        break
                for _ in reply.iter_lines():
                    pass
        except httpx.HTTPError:
            results.put((start, None, prompt))
    with ThreadPoolExecutor(8) as pool:
        while not halt.wait(VICTIM_EVERY_S):
            pool.submit(one)


class MemoryPeak(threading.Thread):
    def __init__(self, r) -> None:
        super().__init__(daemon=True, name="memory")
        self.r, self.peak, self.halt = r, 0, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.5):
            try:
                self.peak = max(self.peak, int(self.r.info("memory")["used_memory"]))
            except Exception:  # noqa: BLE001 - a sample missed is a sample missed
                pass


@dataclass
class Attack:
    base: str
    key: str
    seconds: float
    victim: Victim
    out: Outcomes = field(default_factory=Outcomes)
    leaks: int = 0
    # One client, its connections kept, as a real attacker's: on this shared host, a new httpx client per request
    # (a TLS context made each time) took a whole core for 10 s over the cancel storm's 200 posts, more of the
    # cores B shares than the gateway's answers did.
    http: httpx.Client = field(default_factory=lambda: httpx.Client(limits=httpx.Limits(max_connections=32)))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def post(self, path: str, timeout: float = 600, **kwargs) -> httpx.Response | None:
        try:
            return self.out.note(self.http.post(self.base + path, headers=self.headers, timeout=timeout, **kwargs))
        except httpx.HTTPError as e:
            return self.out.note(e)

    def chat(self, **fields) -> httpx.Response | None:
        body = {"messages": [{"role": "user", "content": phrase(6)}], "max_tokens": 16, **fields}
        return self.post(CHAT, json=body)

    def repeat(self, threads: int, one: Callable[[], object]) -> None:
        """``one`` again and again from ``threads`` threads, for the scenario's seconds."""
        until = time.monotonic() + self.seconds

        def loop() -> None:
            while time.monotonic() < until:
                one()
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(loop) for _ in range(threads)]:
                f.result()

    def batch(self, lines: list[dict], wait: bool = True) -> str | None:
        data = "\n".join(json.dumps(x) for x in lines).encode()
        upload = self.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)})
        if upload is None or upload.status_code != 200:
            return None
        made = self.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": CHAT,
                                              "completion_window": "24h"})
        if made is None or made.status_code != 200:
            return None
        batch_id = made.json()["id"]
        deadline = time.monotonic() + self.seconds * 4
        while wait and time.monotonic() < deadline:
            try:
                got = self.batch_object(batch_id)
            except httpx.HTTPError:
                break  # the gateway went away (the run ended): nothing more to wait for
            if got["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            time.sleep(1)
        return batch_id

    def batch_object(self, batch_id: str) -> dict:
        return self.http.get(f"{self.base}/v1/batches/{batch_id}", headers=self.headers, timeout=60).json()

    def note_batch(self, batch_id: str | None, after_s: float = 5.0) -> None:
        """Print the batch's status and counts ``after_s`` from now (on a thread: the scenario goes on)."""
        def later() -> None:
            time.sleep(after_s)
            try:
                got = self.batch_object(batch_id)
                print(f"  batch {batch_id}: {got['status']} {got['request_counts']}", flush=True)
            except (httpx.HTTPError, KeyError, ValueError) as e:
                print(f"  batch {batch_id}: not read ({e})", flush=True)
        if batch_id is not None:
            threading.Thread(target=later, daemon=True).start()


def line(i: int, **body) -> dict:
    return {"custom_id": f"l{i}", "url": CHAT, "body": {"messages": [{"role": "user", "content": phrase(5)}],
                                                        "max_tokens": 8, **body}}


def unknown_model_batch(a: Attack) -> None:
    a.batch([line(i, model="no-such-model") for i in range(50_000)])


def stop_logit(a: Attack) -> None:
    stops = random.sample(range(1, 40_000), MAX_STOP_TOKEN_IDS)
    bias = {str(t): random.uniform(-5, 5) for t in random.sample(range(40_000), MAX_LOGIT_BIAS)}
    a.chat(stop_token_ids=stops + [40_001])  # one over each bound: 400s naming the field
    a.chat(logit_bias={**bias, "40001": 1.0})
    threading.Thread(target=a.batch, args=([line(i, stop_token_ids=stops, logit_bias=bias) for i in range(200)],),
                     daemon=True).start()
    a.repeat(4, lambda: a.chat(stop_token_ids=stops, logit_bias=bias, max_tokens=64))


def n128(a: Attack) -> None:
    most = MAX_OUTPUT_BUDGET // (128 * 21)
    a.chat(n=128, max_tokens=most + 1, logprobs=True, top_logprobs=20)  # over the budget: a 400
    a.repeat(2, lambda: a.chat(n=128, max_tokens=most, logprobs=True, top_logprobs=20, ignore_eos=True))


def uploads(a: Attack) -> None:
    one = json.dumps(line(0)).encode() + b"\n"
    data = one * ((64 << 20) // len(one) - 8)
    with ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda _: a.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", data)}),
                      range(20)))


def regex(a: Attack) -> None:
    a.chat(structured_outputs={"regex": "(a{100}){100}"})
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^((ab){64}){64}$"}}}
    a.chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    a.repeat(2, lambda: a.chat(structured_outputs={"regex": "[a-z ]{1,4000}"}, max_tokens=32))


def cancel_storm(a: Attack) -> None:
    batch_id = a.batch([line(i, max_tokens=16) for i in range(5_000)], wait=False)
    if batch_id is None:
        return
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: a.post(f"/v1/batches/{batch_id}/cancel"), range(200)))
    a.note_batch(batch_id)


def big_batch(a: Attack) -> None:
    a.note_batch(a.batch([line(i, max_tokens=16) for i in range(5_000)], wait=False))


def replay(a: Attack) -> None:
    """A sends B's prompts as B sent them; a leak is an answer marked cached, or more cached_tokens than A's
    own prompts of the same form find cached (the chat template and the words they share, cached by A itself)."""
    template = 0
    for _ in range(2):
        own = a.post(CHAT, json={"messages": [{"role": "user", "content": victim_prompt()}], "max_tokens": 1,
                                 "temperature": 0})
        template = own.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) if own else 0
    for prompt in a.victim.prompts:
        reply = a.post(CHAT, json={"messages": [{"role": "user", "content": prompt}], "max_tokens": VICTIM_TOKENS,
                                   "temperature": 0})
        if reply is not None and reply.status_code == 200:
            got = reply.json()
            cached = got["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            a.leaks += bool(got.get("cached")) or cached > template


SCENARIOS: dict[str, Callable[[Attack], None]] = {
    "unknown_model_batch": unknown_model_batch, "stop_logit": stop_logit, "n128": n128, "uploads": uploads,
    "regex": regex, "cancel_storm": cancel_storm, "replay": replay}
EXTRA_SCENARIOS: dict[str, Callable[[Attack], None]] = {"big_batch": big_batch}


def start_gateway(settings: Settings, url: str, folder: Path, keys: dict[str, str]) -> tuple[str, object]:
    (folder / "keys.json").write_text(json.dumps({"keys": [{"sha256": hash_key(k), "tenant": t}
                                                            for t, k in keys.items()]}))
    port = free_port()
    env = {**os.environ, **settings_env(settings), "PAGEDQ_BROKER_URL": url}
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--port", str(port), "--api-keys-file",
                  str(folder / "keys.json")], folder / "gateway.log", env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return base, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the gateway did not get ready: {(folder / 'gateway.log').read_text()[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    everything = {**SCENARIOS, **EXTRA_SCENARIOS}
    ap.add_argument("scenarios", nargs="*", help=f"some of: {', '.join(everything)} (default: "
                                                 f"{', '.join(SCENARIOS)})")
    ap.add_argument("--seconds", type=float, default=60, help="how long each scenario (and B alone) runs")
    ap.add_argument("--timeline", action="store_true", help="print each of B's chats in a scenario: when it "
                                                            "started (s into the scenario) and its TTFT")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops the stack it started
    names = args.scenarios or list(SCENARIOS)
    if unknown := [n for n in names if n not in everything]:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(everything)}")
    keys = {"hostile-a": f"sk-{secrets.token_hex(16)}", "victim-b": f"sk-{secrets.token_hex(16)}"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedq-hostile-") as scratch:
        settings = Settings()
        if not settings.broker_url:
            settings = settings.model_copy(update={"redis_dir": Path(scratch) / "redis"})
        with Stack(settings, log_dir=Path(scratch) / "logs") as stack:
            stack.wait_ready(900)
            base, gateway = start_gateway(settings, stack.url, Path(scratch), keys)
            r = redis_client(stack.url)
            maxmemory = int(r.info("memory").get("maxmemory", 0))
            victim = Victim(base, keys["victim-b"])
            victim.start()
            try:
                t0 = time.monotonic()
                time.sleep(args.seconds)
                alone, n_alone = victim.p90_since(t0, time.monotonic())
                print(f"B alone: TTFT p90 {alone * 1e3:.0f} ms over {n_alone} chats", flush=True)
                for name in names:
                    memory = MemoryPeak(r)
                    memory.start()
                    attack = Attack(base, keys["hostile-a"], args.seconds, victim)
                    t0 = time.monotonic()
                    everything[name](attack)
                    left = args.seconds - (time.monotonic() - t0)
                    if left > 0:
                        time.sleep(left)  # B's figure over at least the scenario's seconds
                    p90, n = victim.p90_since(t0, time.monotonic())
                    if args.timeline:
                        print("  B's chats (s into the scenario: TTFT ms): " + ", ".join(
                            f"{s - t0:.0f}: {d * 1e3:.0f}" for s, d in victim.ttfts if s >= t0), flush=True)
                    memory.halt.set()
                    rows.append((name, p90, n, attack, memory.peak))
                    print(f"{name}: B p90 {p90 * 1e3:.0f} ms ({p90 / alone:.2f}x, {n} chats); A: "
                          f"{attack.out.text()}; Redis peak {memory.peak / 2**20:.1f} MiB; leaks {attack.leaks}",
                          flush=True)
                    time.sleep(5)  # let what A left running drain a little before the next scenario
            finally:
                victim.stop()
                stop(gateway, 30)
    bound = f"{maxmemory / 2**20:.0f} MiB" if maxmemory else "none set"
    print(f"\nB alone: TTFT p90 {alone * 1e3:.0f} ms; Redis maxmemory: {bound}; B failures: {victim.failures}")
    print("| scenario | B TTFT p90 ms (x alone) | A's requests | Redis used peak MiB | A saw B's caches |")
    print("|---|---|---|---|---|")
    for name, p90, n, attack, peak in rows:
        print(f"| {name} | {p90 * 1e3:.0f} ({p90 / alone:.2f}x, {n} chats) | {attack.out.text()} | "
              f"{peak / 2**20:.1f} | {attack.leaks} |")


if __name__ == "__main__":
    main()
