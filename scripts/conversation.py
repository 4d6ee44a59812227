#!/usr/bin/env python3
"""A multi-turn chat against a running snapserve: how much of each turn's prompt is restored.

    python3 scripts/conversation.py [--base-url http://127.0.0.1:8000/v1] [--turns 8]
        [--system-tokens 2000] [--reply-tokens 150] [--target 0.95]

One conversation over a long system prompt: each turn sends the whole history plus a new user
message, and reads `usage.prompt_tokens_details.cached_tokens`. Prints a line per turn; exits
non-zero when a turn after the first has less than `--target` of its prompt cached. Only the
standard library is used.
"""

import argparse
import json
import sys
import time
import urllib.request

TOPICS = ["rivers", "mountains", "bread", "bridges", "clocks", "bees", "maps", "winter", "ships",
          "gardens", "glass", "lighthouses", "paper", "trains", "salt", "owls"]


def post(base, body):
    request = urllib.request.Request(f"{base}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as answer:
        reply = json.load(answer)
    return reply, time.monotonic() - started


def system_prompt(tokens):
    # About 1.3 tokens per word for plain English; the server reports the exact count.
    words = []
    i = 0
    while len(words) < tokens * 3 // 4:
        topic = TOPICS[i % len(TOPICS)]
        words += (f"Rule {i + 1}: when the user asks about {topic}, answer plainly, give one "
                  f"concrete example, and never invent facts about {topic}.").split()
        i += 1
    return "You are a careful assistant for a museum of everyday things. " + " ".join(words)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--reply-tokens", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.95)
    args = parser.parse_args()
    messages = [{"role": "system", "content": system_prompt(args.system_tokens)}]
    short = []
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'share':>6} {'reply':>6} {'seconds':>8}")
    for turn in range(args.turns):
        topic = TOPICS[turn % len(TOPICS)]
        messages.append({"role": "user", "content":
                         f"Tell me something about {topic} that a visitor would remember, "
                         f"and how {topic} changed the way people lived."})
        reply, seconds = post(args.base_url, {
            "messages": messages, "max_tokens": args.reply_tokens, "temperature": 0,
        })
        usage = reply["usage"]
        prompt = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        share = cached / prompt
        print(f"{turn + 1:>4} {prompt:>7} {cached:>7} {share:>6.1%} "
              f"{usage['completion_tokens']:>6} {seconds:>8.2f}")
        if turn > 0 and share < args.target:
            short.append(turn + 1)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    if short:
        print(f"turns under {args.target:.0%} cached: {short}")
        return 1
    print(f"every turn after the first had at least {args.target:.0%} of its prompt cached")
    return 0


if __name__ == "__main__":
    sys.exit(main())
