#!/usr/bin/env python3
"""Hugging Face transformers' prefill and decode throughput, measured like `snapserve bench`.

Prefill: one forward pass over `length` random tokens. Decode: `batch` sequences hold
`context` random tokens in transformers' KV cache, then `decode_steps` single-token steps are
timed. Figures are medians of `repeats` runs, printed in `snapserve bench`'s format.

    python3 scripts/hf_baseline.py --model DIR [--device cpu|cuda] [--dtype float32|bfloat16]
        [--threads N] [--prompt-lengths 128,512] [--batches 1] [--contexts 512]
        [--decode-steps 32] [--repeats 3] [--random-config config.json]

With --random-config, the model is built from that config.json with random weights instead
of loaded (the GPU baselines of shapes we have no checkpoint for).
"""

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache


def ints(text):
    return [int(v) for v in text.split(",") if v]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def prefill_once(model, length, vocab, device, generator):
    ids = torch.randint(0, vocab, (1, length), generator=generator).to(device)
    sync(device)
    started = time.perf_counter()
    model(ids, use_cache=False)
    sync(device)
    return time.perf_counter() - started


@torch.no_grad()
def decode_once(model, batch, context, steps, vocab, device, generator):
    ids = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return (time.perf_counter() - started) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--random-config")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int)
    p.add_argument("--prompt-lengths", type=ints, default=[128, 512])
    p.add_argument("--batches", type=ints, default=[1])
    p.add_argument("--contexts", type=ints, default=[512])
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.random_config:
        config = AutoConfig.from_pretrained(args.random_config)
        torch.manual_seed(0)
        # Built on the device: initializing an 8B model on the host takes minutes.
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
        name = args.random_config
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="eager")
        name = args.model
    model = model.to(args.device).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    print(f"transformers baseline: {name} on {args.device} ({args.dtype}), {torch.get_num_threads()} threads")
    prefill_once(model, 16, vocab, args.device, generator)
    for length in args.prompt_lengths:
        t = statistics.median(prefill_once(model, length, vocab, args.device, generator) for _ in range(args.repeats))
        print(f"prefill  length {length:>6}            {length / t:>10.1f} tok/s  {t * 1e3:>9.3f} ms/step", flush=True)
    for context in args.contexts:
        for batch in args.batches:
            runs = [decode_once(model, batch, context, args.decode_steps, vocab, args.device, generator) for _ in range(args.repeats)]
            t = statistics.median(runs)
            print(f"decode   batch {batch:>4}  context {context:>6} {batch / t:>10.1f} tok/s  {t * 1e3:>9.3f} ms/step", flush=True)


if __name__ == "__main__":
    main()
