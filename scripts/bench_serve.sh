#!/usr/bin/env bash
# The serving benchmarks of BENCHMARKS.md (issue 10), each against a fresh server on the
# shipped configs/gpu.toml, driven by `snapserve loadtest` with token-id prompts and ignore_eos:
#
#   (a) 128 prompt / 128 generated tokens, 1,024 requests, 256 in flight;
#   (b) 1,024 / 128, 256 requests, 64 in flight;
#   (c) time to first token at one in flight, new prompts of 1 to 2,048 tokens;
#   (d) a 32,000-token prompt at one in flight: cold, repeated, then repeated with 32 new
#       tokens per request, then repeated generating 16 tokens;
#   (e) (b) again with saves off (save_prompts = false) and with every prompt saved
#       (save_after_sightings = 1): what saving costs on prompts that never repeat;
#   (f) what agents' features cost (issue 12): 128 / 128, 512 requests, 64 in flight, plain,
#       with `response_format` json_object, and with logprobs (top 5);
#   (g) `n` choices sharing one prompt (issue 12): 2,048 / 128, 32 sequences in flight, as 256
#       requests of n = 1 and as 64 requests of n = 4 (the same tokens generated, a quarter of
#       the prompts computed).
#   (h) snapshots across a restart (issue 13): a 32,000-token prompt cold, then the server is
#       stopped with SIGTERM (it flushes its snapshots to the disk tier) and started again, and
#       the same prompt is sent: restored from disk;
#   (i) a kill -9 while the disk tier is being written (during the shutdown flush of three
#       32,000-token snapshots), then a restart: the index is rebuilt from whole files only,
#       and every prompt is answered.
#
# $SNAPSERVE names a prebuilt binary (else cargo builds one); $SERVE_ARGS the model (default:
# the Llama-3.1-8B shape with random weights and $TOKENIZER's tokenizer, default the embedded
# SmolLM2's); $CONFIG the deployment file; $SCENARIOS which to run (default "a b c d e f g").
# Writes each server's log and each table under $OUT (default .).
#
#     [SNAPSERVE=path] [TOKENIZER=dir] [SERVE_ARGS="--model dir"] scripts/bench_serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${SNAPSERVE:-}
if [ -z "$bin" ]; then
    cargo build --release --quiet
    bin=./target/release/snapserve
fi
config=${CONFIG:-configs/gpu.toml}
out=${OUT:-.}
port=${PORT:-8079}
scenarios=${SCENARIOS:-a b c d e f g}
tokenizer_args=()
[ -n "${TOKENIZER:-}" ] && tokenizer_args=(--tokenizer "$TOKENIZER")
default_model="--random-weights --model-config scripts/shapes/llama-3.1-8b.json ${tokenizer_args[*]}"
read -r -a serve_args <<< "${SERVE_ARGS:-$default_model}"

# serve NAME CONFIG_FILE: starts a server, waits for /health and, where the configuration
# has a host snapshot tier, for the tier to be pinned: that runs in the background after
# start-up (~1.6 s for 8 GiB on the H200) and slows the driver's other calls meanwhile.
serve() {
    "$bin" serve "${serve_args[@]}" --config "$2" --port "$port" > "$out/$1.serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1500); do
        if curl -sf "localhost:$port/health" > /dev/null; then
            if grep -q "^host_budget_bytes *= *[1-9]" "$2"; then
                wait_pinned "$1"
            fi
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

# stop NAME: keeps /metrics, stops the server with SIGTERM.
stop() {
    curl -s "localhost:$port/metrics" > "$out/$1.metrics.txt" || true
    kill "$server"
    wait "$server" || echo "the $1 server exited with status $? after SIGTERM" >&2
}

# load NAME ARGS...: one loadtest against the running server, its table kept.
load() {
    local name=$1
    shift
    echo "## $name"
    "$bin" loadtest --url "http://127.0.0.1:$port" "$@" | tee "$out/$name.txt"
}

# with_disk DIR: the configuration with a disk tier of 32 GiB in DIR.
with_disk() {
    sed "/^\[snapshots\]/a disk_dir = \"$1\"\ndisk_budget_bytes = 34359738368" "$config" \
        > "$out/disk.toml"
    echo "$out/disk.toml"
}

# wait_pinned NAME: waits until the server's host snapshot arena is pinned (after a start).
wait_pinned() {
    for _ in $(seq 300); do
        grep -q "pinned .* host snapshot tier" "$out/$1.serve.log" && return
        sleep 0.2
    done
}

# with KEY VALUE: the configuration with one key set.
with() {
    sed "s/^$1 *=.*/$1 = $2/" "$config" > "$out/$1-$2.toml"
    grep -q "^$1 = $2\$" "$out/$1-$2.toml" || { echo "$config has no $1 line" >&2; exit 1; }
    echo "$out/$1-$2.toml"
}

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $config ${serve_args[*]}"
new_1024=(--prefix-tokens 1024 --prefixes 0 --max-tokens 128 --requests 256 --concurrency 64)
for scenario in $scenarios; do
    case $scenario in
    a)
        serve a "$config"
        load "a-128-128" --prefix-tokens 128 --prefixes 0 --max-tokens 128 --requests 1024 \
            --concurrency 256
        stop a
        ;;
    b)
        serve b "$config"
        load "b-1024-128" "${new_1024[@]}"
        stop b
        ;;
    c)
        serve c "$config"
        echo "## c-ttft"
        "$bin" loadtest --url "http://127.0.0.1:$port" --requests 20 \
            --ttft-sweep 1,16,64,128,256,512,1024,2048 | tee "$out/c-ttft.txt"
        stop c
        ;;
    d)
        serve d "$config"
        load "d-32k-repeated" --prefix-tokens 32000 --prefixes 1 --max-tokens 1 --requests 4 \
            --concurrency 1
        load "d-32k-plus-32" --prefix-tokens 32000 --suffix-tokens 32 --prefixes 1 \
            --max-tokens 1 --requests 4 --concurrency 1
        # The same prompt again, 16 tokens each: the first from the kept logits, the rest
        # after the restore (its second token waits for the copy and one forward pass).
        load "d-32k-repeated-16-out" --prefix-tokens 32000 --prefixes 1 --max-tokens 16 \
            --requests 4 --concurrency 1
        stop d
        ;;
    e)
        serve e-off "$(with save_prompts false)"
        load "e-saves-off" "${new_1024[@]}"
        stop e-off
        serve e-every "$(with save_after_sightings 1)"
        load "e-every-prompt-saved" "${new_1024[@]}"
        stop e-every
        ;;
    f)
        serve f "$config"
        short=(--prefix-tokens 128 --prefixes 0 --max-tokens 128 --requests 512 --concurrency 64)
        # A seed each, so that no run restores another's prompts.
        load "f-plain" "${short[@]}" --seed 1
        load "f-json-object" "${short[@]}" --seed 2 \
            --extra-body '{"response_format": {"type": "json_object"}}'
        load "f-logprobs" "${short[@]}" --seed 3 --extra-body '{"logprobs": 5}'
        load "f-plain-again" "${short[@]}" --seed 4
        stop f
        ;;
    g)
        serve g "$config"
        long=(--prefix-tokens 2048 --prefixes 0 --max-tokens 128)
        load "g-n1" "${long[@]}" --requests 256 --concurrency 32 --seed 5
        load "g-n4" "${long[@]}" --requests 64 --concurrency 8 --seed 6 --extra-body '{"n": 4}'
        curl -s "localhost:$port/metrics" | grep "^snapserve_prefix_forked_tokens_total"
        stop g
        ;;
    h)
        disk=${DISK_DIR:-/tmp/snapserve-disk}
        rm -rf "$disk"
        serve h-first "$(with_disk "$disk")"
        load "h-32k-cold" --prefix-tokens 32000 --prefixes 1 --max-tokens 1 --requests 2 \
            --concurrency 1
        stop h-first
        grep -E "flushed|wrote" "$out/h-first.serve.log" || true
        ls -la "$disk"
        serve h-restarted "$(with_disk "$disk")"
        load "h-32k-after-restart" --prefix-tokens 32000 --prefixes 1 --max-tokens 1 \
            --requests 1 --concurrency 1
        load "h-32k-again" --prefix-tokens 32000 --prefixes 1 --max-tokens 1 --requests 2 \
            --concurrency 1
        curl -s "localhost:$port/metrics" | grep -E "^snapserve_(snapshot_corrupt|prefix_reused)"
        stop h-restarted
        ;;
    i)
        disk=${DISK_DIR:-/tmp/snapserve-disk}
        rm -rf "$disk"
        serve i-first "$(with_disk "$disk")"
        for seed in 11 12 13; do
            load "i-32k-$seed" --prefix-tokens 32000 --prefixes 1 --max-tokens 1 --requests 2 \
                --concurrency 1 --seed "$seed" > /dev/null
        done
        kill "$server"
        # Into the shutdown flush (two files at a time): once one file is whole and another
        # is being written, killed outright.
        for _ in $(seq 600); do
            ls "$disk"/*.snap > /dev/null 2>&1 && ls "$disk"/*.tmp > /dev/null 2>&1 && break
            sleep 0.05
        done
        ls -la "$disk"
        kill -9 "$server"
        wait "$server" || true
        echo "killed during the flush; on disk:"
        ls -la "$disk"
        serve i-restarted "$(with_disk "$disk")"
        wait_pinned i-restarted
        grep -E "disk tier" "$out/i-restarted.serve.log"
        for seed in 11 12 13; do
            load "i-after-$seed" --prefix-tokens 32000 --prefixes 1 --max-tokens 1 \
                --requests 1 --concurrency 1 --seed "$seed"
        done
        curl -s "localhost:$port/metrics" | grep -E "^snapserve_(snapshot_corrupt|prefix_reused|requests_total)"
        stop i-restarted
        ;;
    esac
done
