#!/usr/bin/env bash
# The load-test scenarios of BENCHMARKS.md against a fresh server each: the same repeated
# prompts with prompt snapshots on and off, shared openings with questions of their own, and
# prompts that are all new. $SNAPSERVE names a prebuilt binary (else cargo builds one); the
# model is the embedded SmolLM2 (fetched if missing) or $MODEL; $CONFIG is the deployment
# file (default configs/gpu.toml); $REQUESTS, $CONCURRENCY, $WORDS and $MAX_TOKENS size the
# runs. Writes each server's log and /metrics under $OUT (default .).
#
#     [SNAPSERVE=path] [MODEL=dir] [CONFIG=configs/cpu.toml] scripts/loadtest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${SNAPSERVE:-}
if [ -z "$bin" ]; then
    cargo build --release --quiet
    bin=./target/release/snapserve
fi
config=${CONFIG:-configs/gpu.toml}
out=${OUT:-.}
requests=${REQUESTS:-400}
concurrency=${CONCURRENCY:-32}
words=${WORDS:-1000}
max_tokens=${MAX_TOKENS:-64}
port=${PORT:-8077}
model_args=()
if [ -n "${MODEL:-}" ]; then
    model_args=(--model "$MODEL")
fi

# serve NAME CONFIG_FILE: starts a server, waits for /health.
serve() {
    "$bin" serve "${model_args[@]}" --config "$2" --port "$port" > "$out/$1.serve.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
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

# stop NAME: keeps /metrics, stops the server with SIGTERM and checks it exits cleanly.
failures=0
stop() {
    curl -s "localhost:$port/metrics" > "$out/$1.metrics.txt" || true
    kill "$server"
    local status=0
    wait "$server" || status=$?
    if [ "$status" -ne 0 ]; then
        echo "the $1 server exited with status $status after SIGTERM" >&2
        failures=$((failures + 1))
    fi
}

# run NAME ARGS...: one loadtest against the running server.
run() {
    local name=$1
    shift
    echo "## $name"
    "$bin" loadtest --url "http://127.0.0.1:$port" --requests "$requests" \
        --concurrency "$concurrency" --prefix-words "$words" --max-tokens "$max_tokens" "$@" |
        tee "$out/$name.txt"
}

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $config, $requests requests, $concurrency at a time, $words-word prompts, $max_tokens tokens"
serve snapshots "$config"
run repeated --prefixes 8 --suffix-words 0
stop snapshots

sed 's/^save_prompts *=.*/save_prompts = false/' "$config" > "$out/no-snapshots.toml"
if ! grep -q '^save_prompts = false' "$out/no-snapshots.toml"; then
    echo "$config sets no save_prompts line to turn off" >&2
    exit 1
fi
serve no-snapshots "$out/no-snapshots.toml"
run repeated-without-snapshots --prefixes 8 --suffix-words 0
stop no-snapshots

serve shared "$config"
run shared-openings --prefixes 8 --suffix-words 16
stop shared

serve fresh "$config"
run all-new --prefixes 0 --seed 1
stop fresh
exit $((failures > 0))
