"""Print an OpenAI Batch output file as readable completions."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        for line in f:
            item = json.loads(line)
            response = item["response"] or {}
            body = response.get("body") or {}
            print(f"--- {item['custom_id']} (HTTP {response.get('status_code')})")
            if "error" in body:
                print(f"error: {body['error']['message']}")
                continue
            choice = body["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            print(text.strip())
            print(f"[finish_reason={choice['finish_reason']}, usage={body['usage']}]")


if __name__ == "__main__":
    main(sys.argv[1])
