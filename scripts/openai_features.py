#!/usr/bin/env python3
"""The API features agents use, through the openai SDK, against a running snapserve.

    pip install openai
    python3 scripts/openai_features.py [--base-url http://127.0.0.1:8000/v1] [--model NAME]

Checks models.retrieve, json_schema structured output (parsed and checked field by field),
json_object, logprobs/top_logprobs (whole and streamed), forced and named tool calls (whole,
and streamed as the SDK assembles them), a tool result sent back, logit_bias, n choices
(whole and streamed; each what a lone request with its seed draws), best_of, and a list of
prompts in one completion request. Prints one line per check and exits non-zero on any
mismatch.
"""

import argparse
import json
import sys

from openai import OpenAI

failures = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}")
    if not ok:
        failures.append(name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None)
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    check("models.retrieve", client.models.retrieve(model).id == model)

    ask = [{"role": "user", "content": "Describe a person with pets."}]
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=model, messages=ask, max_tokens=120, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )
    try:
        person = json.loads(reply.choices[0].message.content)
        ok = (set(person) == {"name", "age", "pets"} and len(person["name"]) <= 30
              and isinstance(person["age"], int) and 0 <= person["age"] <= 120
              and len(person["pets"]) <= 3 and all(isinstance(p, str) for p in person["pets"]))
    except (json.JSONDecodeError, TypeError) as e:
        ok, person = False, str(e)
    check("response_format json_schema", ok, str(person))

    reply = client.chat.completions.create(
        model=model, max_tokens=120, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the name and the age of a cat, in JSON."}],
    )
    try:
        ok = isinstance(json.loads(reply.choices[0].message.content), dict)
    except json.JSONDecodeError:
        ok = False
    check("response_format json_object", ok, reply.choices[0].message.content)

    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    ok = (len(content) == reply.usage.completion_tokens
          and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
          and all(c.top_logprobs[0].token == c.token for c in content)
          and "".join(c.token for c in content) == reply.choices[0].message.content)
    check("logprobs / top_logprobs", ok, str(content)[:200])
    streamed = []
    for chunk in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3, stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    check("logprobs streamed", [c.token for c in streamed] == [c.token for c in content])

    tools = [
        {"type": "function", "function": {
            "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "The current time in a time zone.",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                           "required": ["zone"], "additionalProperties": False}}},
    ]
    weather = [{"role": "user", "content": "What is the weather like in Paris?"}]
    reply = client.chat.completions.create(
        model=model, messages=weather, tools=tools, tool_choice="required", max_tokens=80,
        temperature=0,
    )
    calls = reply.choices[0].message.tool_calls or []
    ok = reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    if ok:
        arguments = json.loads(calls[0].function.arguments)
        ok = calls[0].function.name in ("get_weather", "get_time") and isinstance(arguments, dict)
    check("tool_choice required", ok, str(reply.choices[0]))

    named = client.chat.completions.create(
        model=model, messages=weather, tools=tools, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    named_calls = named.choices[0].message.tool_calls or []
    check("tool_choice named", [c.function.name for c in named_calls] == ["get_time"])

    with client.chat.completions.stream(
        model=model, messages=weather, tools=tools, tool_choice="required", max_tokens=80,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assembled = final.choices[0].message.tool_calls or []
    check("tool call streamed and assembled by the SDK",
          calls and [(c.function.name, c.function.arguments) for c in assembled]
          == [(c.function.name, c.function.arguments) for c in calls],
          str(assembled))

    if calls:
        answer = client.chat.completions.create(
            model=model, max_tokens=30, temperature=0, tools=tools, tool_choice="none",
            messages=weather + [
                {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                {"role": "tool", "tool_call_id": calls[0].id,
                 "content": json.dumps({"temperature": 21, "sky": "clear"})},
            ],
        )
        check("tool result answered in text", bool(answer.choices[0].message.content)
              and not answer.choices[0].message.tool_calls)

    biased = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
        logit_bias={"28": 100},
    )
    plain = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
        logprobs=0,
    )
    check("logit_bias forces a token",
          biased.choices[0].text != plain.choices[0].text, f"{biased.choices[0].text!r}")

    several = client.chat.completions.create(
        model=model, messages=ask, n=3, seed=7, temperature=1.0, max_tokens=12,
    )
    lone = [
        client.chat.completions.create(
            model=model, messages=ask, seed=7 + i, temperature=1.0, max_tokens=12,
        ).choices[0].message.content
        for i in range(3)
    ]
    check("n = 3 choices, each what its seed draws alone",
          [c.index for c in several.choices] == [0, 1, 2]
          and [c.message.content for c in several.choices] == lone,
          f"{[c.message.content for c in several.choices]} vs {lone}")
    streamed = client.chat.completions.create(
        model=model, messages=ask, n=2, seed=7, temperature=1.0, max_tokens=12, stream=True,
    )
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    check("n = 2 streamed, chunks by index", texts == lone[:2], f"{texts} vs {lone[:2]}")

    ranked = client.completions.create(
        model=model, prompt="The old lighthouse keeper said", best_of=3, n=1, seed=80,
        temperature=1.2, max_tokens=8, logprobs=0,
    )
    means = []
    for i in range(3):
        alone = client.completions.create(
            model=model, prompt="The old lighthouse keeper said", seed=80 + i,
            temperature=1.2, max_tokens=8, logprobs=0,
        ).choices[0]
        lps = alone.logprobs.token_logprobs
        means.append((sum(lps) / max(len(lps), 1), alone.text))
    check("best_of answers the likeliest candidate",
          len(ranked.choices) == 1 and ranked.choices[0].text == max(means)[1],
          f"{ranked.choices[0].text!r} vs {means}")

    prompts = ["The old lighthouse keeper said", "Once upon a time"]
    listed = client.completions.create(
        model=model, prompt=prompts, n=2, seed=5, temperature=1.0, max_tokens=6,
    )
    lone = [
        client.completions.create(
            model=model, prompt=prompt, seed=5 + i, temperature=1.0, max_tokens=6,
        ).choices[0].text
        for prompt in prompts
        for i in range(2)
    ]
    got = [c.text for c in sorted(listed.choices, key=lambda c: c.index)]
    check("a list of prompts, n = 2 each, choices numbered across them", got == lone,
          f"{got} vs {lone}")
    token_lists = client.completions.create(
        model=model, prompt=[[504, 3218, 314], [12, 13]], max_tokens=4, temperature=0,
    )
    check("a list of token-id prompts", len(token_lists.choices) == 2
          and token_lists.usage.prompt_tokens == 5, f"{token_lists}")

    # Scoring a text as lm-evaluation-harness's loglikelihood requests do: echo the prompt
    # with its tokens' logprobs, one token generated.
    scored = client.completions.create(
        model=model, prompt="The capital of France is Paris", max_tokens=1, temperature=0,
        echo=True, logprobs=1,
    )
    lp = scored.choices[0].logprobs
    ok = (scored.choices[0].text.startswith("The capital of France is Paris")
          and len(lp.tokens) == scored.usage.prompt_tokens + 1
          and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
          and all(x is not None and x <= 0 for x in lp.token_logprobs[1:]))
    check("echo with logprobs scores the prompt", ok, f"{lp}")

    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
