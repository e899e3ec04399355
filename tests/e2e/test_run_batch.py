"""`pagedq run-batch --offline`: OpenAI Batch lines in, output lines in input order, bad rows as errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine_fixtures import engine, greedy, sharegpt_prompts


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


BAD_LINES = {
    "malformed": '{"custom_id": "malformed", "method": "POST", "url": ',
    "bad-url": line("bad-url", chat("hi"), url="/v1/embeddings"),
    "neg-max": line("neg-max", chat("hi", max_tokens=-3)),
    "cold": line("cold", chat("hi", temperature=-0.5)),
    "top-p-zero": line("top-p-zero", chat("hi", top_p=0)),
    "top-p-big": line("top-p-big", chat("hi", top_p=1.01)),
    "too-long": line("too-long", {"prompt": "hello " * 9000, "max_tokens": 4}, url="/v1/completions"),
    "unknown-model": line("unknown-model", chat("hi", model="gpt-imaginary")),
    "no-messages": line("no-messages", {"messages": []}),
    "bad-role": line("bad-role", {"messages": [{"role": "wizard", "content": "hi"}]}),
}
EXPECTED_PARAM = {"bad-url": "url", "neg-max": "max_tokens", "cold": "temperature", "top-p-zero": "top_p",
                  "top-p-big": "top_p", "too-long": "prompt", "unknown-model": "model",
                  "no-messages": "messages", "bad-role": "messages.0.role"}


def run_batch(tmp_path, lines: list[str | bytes]) -> list[dict]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    env = {**os.environ, "PAGEDQ_KV_CACHE_MEMORY": "256MiB"}
    proc = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "run-batch", "--offline", "-i", str(src),
                           "-o", str(dst)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "requests" in proc.stderr, "a progress bar is drawn on stderr"
    return [json.loads(x) for x in dst.read_text().splitlines()]


def test_good_and_bad_rows(tmp_path):
    prompts = ["What is the capital of Italy?", "Name a prime number.", "Say hello in French."]
    good = [line(f"good{i}", chat(p, max_tokens=12, temperature=0)) for i, p in enumerate(prompts)]
    good.append(line("text", {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "logprobs": 2},
                     url="/v1/completions"))
    lines = []
    for i, bad in enumerate(BAD_LINES.values()):  # interleave so order is tested
        lines.append(bad)
        if i < len(good):
            lines.append(good[i])
    out = run_batch(tmp_path, lines)
    assert len(out) == len(lines)
    ids = [o["custom_id"] for o in out]
    assert ids == [json.loads(x).get("custom_id") if x != BAD_LINES["malformed"] else None for x in lines]

    for o in out:
        status = o["response"]["status_code"]
        if o["custom_id"] is None or o["custom_id"] in BAD_LINES:
            assert status == 400
            err = o["response"]["body"]["error"]
            assert err["message"] and o["error"]["message"] == err["message"]
            if o["custom_id"] in EXPECTED_PARAM:
                assert err["param"] == EXPECTED_PARAM[o["custom_id"]], (o["custom_id"], err)
        else:
            assert status == 200, o
            body = o["response"]["body"]
            usage = body["usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
    by_id = {o["custom_id"]: o for o in out}
    assert by_id[None]["response"]["body"]["error"]["param"] == "line"
    text = by_id["text"]["response"]["body"]
    assert text["object"] == "text_completion" and len(text["choices"][0]["logprobs"]["tokens"]) == 6
    assert by_id["good0"]["response"]["body"]["object"] == "chat.completion"


def test_outputs_equal_the_engine_greedy_tokens(tmp_path):
    """The batch path adds nothing to the tokens: same ids as the engine called directly."""
    eng = engine()
    prompts = sharegpt_prompts()[:3]
    lines = [line(f"p{i}", {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
                  url="/v1/completions") for i, p in enumerate(prompts)]
    out = run_batch(tmp_path, lines)
    want = eng.generate(prompts, greedy(10))
    for o, w in zip(out, want, strict=True):
        assert o["response"]["body"]["choices"][0]["text"] == eng.tokenizer.decode(w.output_token_ids,
                                                                                   skip_special_tokens=True)


def test_lines_no_parser_takes_are_one_error_line_each(tmp_path):
    """A deeply nested line, a lone surrogate in custom_id, bytes that are not UTF-8: each its own error line."""
    deep = '{"custom_id": "deep", "url": "/v1/completions", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    surrogate = line("x", chat("hi")).replace('"x"', '"\\ud800"')
    latin1 = b'{"custom_id": "latin1", "url": "/v1/chat/completions", "body": {"messages": ' \
             b'[{"role": "user", "content": "caf\xe9"}]}}'
    good = [line(f"good{i}", chat(f"Say {i}.", max_tokens=3, temperature=0)) for i in range(2)]
    out = run_batch(tmp_path, [good[0], deep, surrogate, latin1, good[1]])
    status = [o["response"]["status_code"] for o in out]
    assert status == [200, 400, 400, 400, 200]
    errors = [(o["custom_id"], o["response"]["body"]["error"]["param"]) for o in out[1:4]]
    assert errors == [(None, "line"), (None, "custom_id"), ("latin1", "messages.0.content")]
    assert [o["custom_id"] for o in (out[0], out[4])] == ["good0", "good1"]
