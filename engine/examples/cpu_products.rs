//! Times the CPU backend's batch-invariant product on SmolLM2-135M's projection shapes, with
//! Q8_0 and Q4_1 weights as the embedded GGUF stores them, for 1 to 8 input rows (a decode
//! step and a verification of up to 8 positions):
//!
//!     cargo run --release -p engine --example cpu_products [-- ROUNDS]
//!
//! Prints, per weight type and row count, milliseconds for one pass over every projection of
//! the 30 layers and the tied head, and the f32 multiply-adds per nanosecond it reached.
use std::time::Instant;

use engine::cpu::blocks::{BlockQ4_1, BlockQ8_0, Q4_1_FILE_BYTES, Q8_0_FILE_BYTES};
use engine::cpu::matmul::{Weight, matmul};

/// (k, n) of one layer's products and how many layers have it, then the head.
const SHAPES: [(usize, usize, usize); 5] = [
    (576, 960, 30),
    (576, 576, 30),
    (576, 3072, 30),
    (1536, 576, 30),
    (576, 49152, 1),
];

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Small scales: the high bytes of an f16 kept near 2^-7.
            (s >> 33) as u8
        })
        .collect()
}

fn blocks<W>(k: usize, n: usize, bytes: usize, parse: fn(&[u8]) -> Vec<W>, seed: u64) -> Vec<W> {
    let mut raw = random_bytes(n * k / 32 * bytes, seed);
    for block in raw.chunks_exact_mut(bytes) {
        block[0] = 0x00;
        block[1] = 0x20; // f16 2^-7
        if bytes == Q4_1_FILE_BYTES {
            block[2] = 0x00;
            block[3] = 0xa0; // minimum -2^-7
        }
    }
    parse(&raw)
}

fn time<W: Weight>(name: &str, weights: &[(usize, usize, usize, Vec<W>)], rounds: usize) {
    for rows in [1, 2, 4, 8] {
        let mut best = f64::MAX;
        for _ in 0..rounds {
            let start = Instant::now();
            for (k, n, layers, w) in weights {
                let x = vec![0.5f32; rows * k];
                let mut out = vec![0f32; rows * n];
                for _ in 0..*layers {
                    matmul(&x, rows, *k, w, *n, &mut out);
                }
            }
            best = best.min(start.elapsed().as_secs_f64());
        }
        let fmas: usize = weights.iter().map(|(k, n, l, _)| rows * k * n * l).sum();
        println!(
            "{name} rows {rows}: {:8.2} ms  {:5.1} multiply-adds/ns",
            best * 1e3,
            fmas as f64 / best / 1e9
        );
    }
}

/// Random blocks of `bytes` each for every shape of [`SHAPES`].
#[allow(clippy::type_complexity)]
fn every_shape<W>(bytes: usize, parse: fn(&[u8]) -> Vec<W>) -> Vec<(usize, usize, usize, Vec<W>)> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, &(k, n, l))| (k, n, l, blocks(k, n, bytes, parse, i as u64)))
        .collect()
}

fn main() {
    let rounds = std::env::args()
        .nth(1)
        .map_or(5, |r| r.parse().expect("ROUNDS is a count"));
    time(
        "q8_0",
        &every_shape(Q8_0_FILE_BYTES, BlockQ8_0::parse),
        rounds,
    );
    time(
        "q4_1",
        &every_shape(Q4_1_FILE_BYTES, BlockQ4_1::parse),
        rounds,
    );
    let f32s: Vec<_> = SHAPES
        .iter()
        .map(|&(k, n, l)| (k, n, l, vec![0.01f32; k * n]))
        .collect();
    time("f32", &f32s, rounds);
}
