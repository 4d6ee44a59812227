#!/usr/bin/env bash
# CPU throughput of snapserve next to Hugging Face transformers, on the same machine in one
# run, on the converted SmolLM2 (f32). Needs a Python with torch and transformers as $PYTHON.
#
#     PYTHON=/path/to/python scripts/bench_cpu.sh [threads]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-$(nproc)}
python=${PYTHON:-python3}
cargo build --release --quiet
model=$(./target/release/snapserve fetch-model smollm2 --dtype f32 | tail -n 1)
lengths=128,512,1024
contexts=128,512,1024
echo "# $(date -u +%Y-%m-%dT%H:%MZ) on $(nproc) cores ($(lscpu | sed -n 's/^Model name: *//p')), $threads threads"
./target/release/snapserve bench --model "$model" --threads "$threads" \
    --prompt-lengths $lengths --batches 1 --contexts $contexts --decode-steps 32 --repeats 3
"$python" scripts/hf_baseline.py --model "$model" --threads "$threads" \
    --prompt-lengths $lengths --batches 1 --contexts $contexts --decode-steps 32 --repeats 3
