#!/usr/bin/env bash
# Speculative decoding through HTTP (issue 14): a fresh server with speculation off, then one
# with `[speculative] method = "prompt_lookup"`, each sent the prompts of
# scripts/speculation_prompts.txt (or $PROMPTS) one at a time by scripts/speculation_client.py
# (greedy chat turns, streamed), then, with LOAD set, a load of 128-token prompts / 128 tokens
# with LOAD requests in flight (4 × LOAD requests) by `snapserve loadtest`.
#
# $SNAPSERVE names a prebuilt binary (else cargo builds one); $SERVE_ARGS the model (default:
# the embedded one); $CONFIG the deployment file (default configs/gpu.toml); $PROMPTS the
# prompts (default scripts/speculation_prompts.txt; scripts/free_text_prompts.txt holds
# answers that copy nothing, to see what speculation costs there); $OUT where each server's
# log, metrics and table go (default .).
#
#     [SNAPSERVE=path] [SERVE_ARGS="--model dir"] [CONFIG=file] [PROMPTS=file] [LOAD=64] scripts/bench_speculation.sh
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
read -r -a serve_args <<< "${SERVE_ARGS:-}"

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $config ${serve_args[*]}"
server=
trap '[ -n "$server" ] && kill "$server" 2> /dev/null || true' EXIT
for mode in off on; do
    cfg="$out/speculation-$mode.toml"
    cp "$config" "$cfg"
    if [ "$mode" = on ]; then
        printf '\n[speculative]\nmethod = "prompt_lookup"\n' >> "$cfg"
    fi
    "$bin" serve "${serve_args[@]}" --config "$cfg" --port "$port" > "$out/speculation-$mode.serve.log" 2>&1 &
    server=$!
    up=
    for _ in $(seq 1500); do
        if curl -sf "localhost:$port/health" > /dev/null; then
            up=1
            break
        fi
        kill -0 "$server" 2> /dev/null || break
        sleep 0.2
    done
    if [ -z "$up" ]; then
        cat "$out/speculation-$mode.serve.log"
        exit 1
    fi
    # A GPU server pins its host snapshot tier in the background after it starts (~1.6 s for
    # 8 GiB on the H200), which slows the driver's other calls: time requests after it.
    if grep -q "host_budget_bytes *= *[1-9]" "$cfg"; then
        for _ in $(seq 300); do
            grep -q "pinned .* host snapshot tier" "$out/speculation-$mode.serve.log" && break
            sleep 0.2
        done
    fi
    echo "## speculation $mode: one request at a time"
    python3 scripts/speculation_client.py "http://127.0.0.1:$port" "${PROMPTS:-scripts/speculation_prompts.txt}" \
        | tee "$out/speculation-$mode.txt"
    if [ -n "${LOAD:-}" ]; then
        echo "## speculation $mode: $LOAD in flight"
        "$bin" loadtest --url "http://127.0.0.1:$port" --prefix-tokens 128 --prefixes 0 \
            --max-tokens 128 --requests $((4 * LOAD)) --concurrency "$LOAD" \
            | tee "$out/speculation-$mode-load.txt"
    fi
    curl -s "localhost:$port/metrics" > "$out/speculation-$mode.metrics.txt" || true
    grep '^snapserve_speculative' "$out/speculation-$mode.metrics.txt" || true
    kill "$server"
    wait "$server" || true
done
