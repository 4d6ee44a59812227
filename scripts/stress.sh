#!/usr/bin/env bash
# The stress scenarios of BENCHMARKS.md against fresh servers:
#
# 1. one long new prompt (LONG_WORDS words) sent again and again beside two clients of short
#    requests, for each admission.max_step_ms in STEPS: what a long prefill does to everyone
#    else's time to first token and inter-token gaps;
# 2. an overload soak: ten times the queue (max_queue = SOAK_QUEUE) for SOAK_S seconds with 30%
#    of the clients hanging up early, then the server's queue, running requests and used KV
#    pages, which must be back to zero, and a SIGTERM that must find nothing to cut
#    (SOAK_S=0 skips it).
#
# $SNAPSERVE names a prebuilt binary (else cargo builds one); $SERVE_ARGS are added to every
# `snapserve serve` (a --model, or --random-weights --model-config FILE --tokenizer DIR); $CONFIG is the
# deployment file (default configs/cpu.toml). Writes each server's log and each table under
# $OUT (default .).
#
#     [SNAPSERVE=path] [CONFIG=configs/gpu.toml] [SERVE_ARGS=...] scripts/stress.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${SNAPSERVE:-}
if [ -z "$bin" ]; then
    cargo build --release --quiet
    bin=./target/release/snapserve
fi
config=${CONFIG:-configs/cpu.toml}
out=${OUT:-.}
steps=${STEPS-100 250 1000}
long_words=${LONG_WORDS:-7900}
long_s=${LONG_S:-30}
soak_queue=${SOAK_QUEUE:-64}
soak_s=${SOAK_S:-60}
port=${PORT:-8078}
read -r -a serve_args <<< "${SERVE_ARGS:-}"

# serve NAME CONFIG_FILE: starts a server, waits for /health.
serve() {
    "$bin" serve "${serve_args[@]}" --config "$2" --port "$port" > "$out/$1.serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1500); do
        if curl -sf "localhost:$port/health" > /dev/null; then
            return
        fi
        if ! kill -0 "$server" 2> /dev/null; then
            cat "$out/$1.serve.log"
            exit 1
        fi
        sleep 0.2
    done
    echo "the server did not come up" >&2
    exit 1
}

# stop NAME: stops the server with SIGTERM and reports its exit status.
stop() {
    kill "$server"
    local status=0
    wait "$server" || status=$?
    echo "$1: the server exited with status $status after SIGTERM"
}

# with KEY VALUE: the configuration with one [admission] key set.
with() {
    sed "s/^$1 *=.*/$1 = $2/" "$config" > "$out/$1-$2.toml"
    grep -q "^$1 = $2\$" "$out/$1-$2.toml" || { echo "$config has no $1 line" >&2; exit 1; }
    echo "$out/$1-$2.toml"
}

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $config ${SERVE_ARGS:-}"
for ms in $steps; do
    echo "## max_step_ms = $ms: one $long_words-word prompt at a time beside short requests"
    serve "step-$ms" "$(with max_step_ms "$ms")"
    "$bin" loadtest --url "http://127.0.0.1:$port" --duration-s "$long_s" --concurrency 2 \
        --prefixes 0 --prefix-words 4 --suffix-words 0 --max-tokens 8 \
        --long-prompt-words "$long_words" | tee "$out/step-$ms.txt"
    stop "step-$ms"
done

[ "$soak_s" = 0 ] && exit 0
echo "## soak: $((10 * soak_queue)) clients against a queue of $soak_queue for $soak_s s, 30% hanging up"
serve soak "$(with max_queue "$soak_queue")"
"$bin" loadtest --url "http://127.0.0.1:$port" --duration-s "$soak_s" \
    --concurrency $((10 * soak_queue)) --prefixes 4 --prefix-words 200 --max-tokens 64 \
    --disconnect-fraction 0.3 --check-idle | tee "$out/soak.txt"
stop soak
