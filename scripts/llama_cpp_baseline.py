#!/usr/bin/env python3
"""llama.cpp's CPU prefill and decode throughput on a GGUF file, measured like `snapserve bench`.

Through llama-cpp-python (`pip install llama-cpp-python`, which builds llama.cpp from source:
~10 minutes on 2 cores; `CMAKE_ARGS="-DGGML_NATIVE=ON"` tunes it to the machine). Decode:
`context` random tokens evaluated, then `decode_steps` greedy single-token steps timed. Prefill:
one evaluation of `length` random tokens. Medians of `repeats` rounds after a warm-up round,
printed in `snapserve bench`'s format. The GGUF snapserve converts its embedded model from
lies in its cache after `snapserve fetch-model` (`~/.cache/snapserve/gguf/`).

    python3 scripts/llama_cpp_baseline.py GGUF [--threads 2] [--context 128] [--length 512]
        [--decode-steps 32] [--repeats 3]
"""

import argparse
import statistics
import time

import numpy as np
from llama_cpp import Llama


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    llm = Llama(model_path=a.gguf, n_threads=a.threads, n_threads_batch=a.threads,
                n_ctx=max(a.context + a.decode_steps, a.length) + 16, n_batch=512,
                verbose=False)
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()

    def tokens(n):
        return [int(t) for t in rng.integers(100, vocab - 100, n)]

    def greedy():
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    decode, prefill = [], []
    for _ in range(a.repeats + 1):
        llm.reset()
        llm.eval(tokens(a.context))
        token = greedy()
        started = time.perf_counter()
        for _ in range(a.decode_steps):
            llm.eval([token])
            token = greedy()
        decode.append((time.perf_counter() - started) / a.decode_steps)
        llm.reset()
        prompt = tokens(a.length)
        started = time.perf_counter()
        llm.eval(prompt)
        prefill.append(time.perf_counter() - started)
    step = statistics.median(prefill[1:])
    print(f"prefill  length {a.length:>6}            {a.length / step:>10.1f} tok/s  "
          f"{step * 1e3:>9.3f} ms/step")
    step = statistics.median(decode[1:])
    print(f"decode   batch {1:>4}  context {a.context:>6} {1 / step:>10.1f} tok/s  "
          f"{step * 1e3:>9.3f} ms/step")


if __name__ == "__main__":
    main()
