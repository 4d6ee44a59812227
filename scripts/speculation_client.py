#!/usr/bin/env python3
"""Speculative decoding as a user sees it: each prompt of a file (one per line) sent to a
running snapserve as a chat turn, greedy, one request at a time, streamed; prints per prompt
the median decode speed (tokens after the first, over the time from the first to the last
chunk), the completion tokens and a hash of the text, as one JSON line each.

    scripts/speculation_client.py URL PROMPTS_FILE [--max-tokens N] [--repeats N]
"""
import argparse
import hashlib
import json
import statistics
import time
import urllib.request


def one(url, model, prompt, max_tokens):
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body,
        headers={"Content-Type": "application/json"})
    text, tokens, first, last = [], None, None, None
    sent = time.perf_counter()
    with urllib.request.urlopen(request) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    return "".join(text), tokens, first - sent, last - first


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("prompts")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = [line.strip() for line in f if line.strip()]
    with urllib.request.urlopen(args.url + "/v1/models") as response:
        model = json.load(response)["data"][0]["id"]
    for i, prompt in enumerate(prompts, 1):
        runs = [one(args.url, model, prompt, args.max_tokens) for _ in range(args.repeats)]
        texts = {hashlib.sha256(r[0].encode()).hexdigest()[:12] for r in runs}
        speeds = [(r[1] - 1) / r[3] for r in runs if r[1] and r[1] > 1 and r[3] > 0]
        print(json.dumps({
            "prompt": i,
            "completion_tokens": runs[0][1],
            "decode_tok_s": round(statistics.median(speeds), 1) if speeds else None,
            "ttft_ms": round(statistics.median(r[2] for r in runs) * 1e3, 1),
            "text": "/".join(sorted(texts)),
        }), flush=True)


if __name__ == "__main__":
    main()
