#!/usr/bin/env bash
# GPU throughput of snapserve next to Hugging Face transformers, on the same machine in one run:
# the shapes of SmolLM2-135M and Llama-3.1-8B (scripts/shapes/*.json) with random bf16 weights
# (drawn on the GPU by snapserve, by torch's initializers in transformers), and the device's
# copy bandwidth, the denominator of the decode roofline. Needs a CUDA GPU and a Python with
# torch and transformers as $PYTHON; $SNAPSERVE names a prebuilt binary (else cargo builds one).
#
#     [SNAPSERVE=path/to/snapserve] [PYTHON=python3] scripts/bench_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${SNAPSERVE:-}
if [ -z "$bin" ]; then
    cargo build --release --quiet
    bin=./target/release/snapserve
fi
python=${PYTHON:-python3}
small=scripts/shapes/smollm2-135m.json
big=scripts/shapes/llama-3.1-8b.json
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
"$python" - <<'PY'
import torch
x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    y.copy_(x)
end.record()
torch.cuda.synchronize()
seconds = start.elapsed_time(end) / 1e3 / 20
print(f"device copy: {2 * x.numel() / seconds / 1e12:.2f} TB/s (bytes read + written, 4 GiB buffers)")
PY
# SmolLM2's context is 8192 positions: its long decode context leaves room for the timed steps.
"$bin" bench --backend cuda --random-weights --model-config $small \
    --prompt-lengths 128,1024,8192 --batches 1,8,32,128,256 --contexts 512,8000 \
    --decode-steps 32 --repeats 3
"$bin" bench --backend cuda --random-weights --model-config $big \
    --prompt-lengths 128,1024,8192 --batches 1,8,32,64,128,256 --contexts 512,1024,8192 \
    --decode-steps 32 --repeats 3
# Small-batch decode with every projection through cuBLAS, for comparison with the gemv kernel
# (engine/src/cuda/forward.rs says where that is used by default).
for shape in $small $big; do
    "$bin" bench --backend cuda --random-weights --model-config $shape --gemv-max-tokens 0 \
        --prompt-lengths 128 --batches 1,8 --contexts 512 --decode-steps 32 --repeats 3
done
# The 8B shape with the gemv for weights of at most 8 MiB (none of its projections) and at
# most 128 MiB (its down projection too), beside the default cut of 64 MiB.
for mib in 8 128; do
    "$bin" bench --backend cuda --random-weights --model-config $big --gemv-max-weight-mib $mib \
        --prompt-lengths 128 --batches 1 --contexts 512 --decode-steps 32 --repeats 3
done
"$python" scripts/hf_baseline.py --device cuda --dtype bfloat16 --random-config $small \
    --prompt-lengths 128,1024,8192 --batches 1,32 --contexts 512 --decode-steps 32 --repeats 3
"$python" scripts/hf_baseline.py --device cuda --dtype bfloat16 --random-config $big \
    --prompt-lengths 128,1024 --batches 1,32,64 --contexts 512,1024 --decode-steps 16 --repeats 2
