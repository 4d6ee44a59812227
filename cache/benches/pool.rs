//! The working pool's per-step operations on a large pool: they must not depend on its size.

use std::hint::black_box;

use cache::{PagePool, PoolConfig};
use criterion::{Criterion, criterion_group, criterion_main};
use policy::ReservationPolicy;

const PAGE_TOKENS: usize = 16;

fn pool(reservation: ReservationPolicy) -> PagePool {
    PagePool::new(PoolConfig {
        total_pages: 1 << 20,
        page_tokens: PAGE_TOKENS,
        max_slots: 256,
        reservation,
    })
}

fn allocate_and_free(c: &mut Criterion) {
    let mut group = c.benchmark_group("pool");
    let mut warm = pool(ReservationPolicy::Optimistic);
    let running: Vec<_> = (0..255).map(|_| warm.admit(4096, 0).unwrap()).collect();
    for &slot in &running {
        warm.extend(slot, 4096).unwrap();
    }

    group.bench_function("admit, extend one page, release", |b| {
        b.iter(|| {
            let slot = warm.admit(PAGE_TOKENS, 0).unwrap();
            black_box(warm.extend(slot, PAGE_TOKENS).unwrap());
            warm.release(slot).unwrap()
        })
    });

    let slot = running[7];
    group.bench_function("extend one page, truncate it (allocate + free)", |b| {
        warm.truncate(slot, 4096 - PAGE_TOKENS).unwrap();
        b.iter(|| {
            black_box(warm.extend(slot, PAGE_TOKENS).unwrap());
            warm.truncate(slot, 4096 - PAGE_TOKENS).unwrap()
        })
    });

    group.bench_function("speculative step: extend 8 tokens, roll back 5", |b| {
        let mut worst = pool(ReservationPolicy::WorstCase);
        let slot = worst.admit(4096, 4096).unwrap();
        worst.extend(slot, 4096).unwrap();
        b.iter(|| {
            let tokens = worst.tokens(slot).unwrap();
            black_box(worst.extend(slot, 8).unwrap());
            worst.truncate(slot, tokens + 3).unwrap();
            // Start the sequence over before it reaches its limit, so every step is alike.
            if tokens > 8000 {
                worst.truncate(slot, 4096).unwrap();
            }
        })
    });
    group.finish();
}

criterion_group!(benches, allocate_and_free);
criterion_main!(benches);
