//! The snapshot store's operations at scale: longest-prefix lookup of a 4,096-page chain among
//! 10,000 snapshots, saves that evict under pressure, restore planning, and prefix hashing.

use std::hint::black_box;

use cache::{
    KvGeometry, PageId, PrefixHash, PrefixHasher, PrefixSalt, SaveStart, SnapshotGeometry,
    SnapshotStore, Tier,
};
use criterion::{Criterion, criterion_group, criterion_main};
use policy::SnapshotConfig;

const PAGE_TOKENS: usize = 16;
const CHAIN_PAGES: usize = 4096;

/// SmolLM2-135M's KV: 30 layers, 3 KV heads of 64, bf16: 23,040 bytes a token.
fn geometry() -> SnapshotGeometry {
    let kv = KvGeometry {
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        page_tokens: PAGE_TOKENS,
        dtype_bytes: 2,
    };
    SnapshotGeometry {
        kv,
        fixed_state_bytes: 0,
    }
}

fn store(device_budget_bytes: u64) -> SnapshotStore {
    let config = SnapshotConfig {
        device_budget_bytes,
        ..Default::default()
    };
    SnapshotStore::new(geometry(), &config.validate().unwrap())
}

fn hasher() -> PrefixHasher {
    PrefixHasher::new(PrefixSalt::new("bench", None), PAGE_TOKENS)
}

/// A deterministic token stream, different for every `seed`.
fn tokens(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(2_654_435_761) % 50_000)
        .collect()
}

fn save(store: &mut SnapshotStore, chain: &[PrefixHash]) -> bool {
    match store
        .begin_save(chain, Tier::Device)
        .expect("the bench budget fits")
    {
        SaveStart::Reserved { reservation, .. } => {
            store.commit_save(reservation).unwrap();
            true
        }
        SaveStart::AlreadyStored(_) | SaveStart::NotSeenEnough => false,
    }
}

/// 10,000 snapshots: one of a whole 4,096-page document (`conversations[10]`), and 9,999 of 10
/// conversations of 4,096 pages, about 1,000 each at scattered lengths.
fn conversations_store() -> (SnapshotStore, Vec<Vec<PrefixHash>>) {
    let conversations: Vec<Vec<PrefixHash>> = (0..11)
        .map(|seed| hasher().chain(&tokens(seed, CHAIN_PAGES * PAGE_TOKENS)))
        .collect();
    let mut store = store(u64::MAX);
    save(&mut store, &conversations[10]);
    let mut saved = 1;
    for step in 0u64.. {
        let chain = &conversations[(step % 10) as usize];
        let pages = (step.wrapping_mul(2_654_435_761) % CHAIN_PAGES as u64) as usize + 1;
        saved += save(&mut store, &chain[..pages]) as usize;
        if saved == 10_000 {
            break;
        }
    }
    (store, conversations)
}

fn lookup(c: &mut Criterion) {
    let (mut store, conversations) = conversations_store();
    let unrelated = hasher().chain(&tokens(99, CHAIN_PAGES * PAGE_TOKENS));
    let leaving = |chain: &[PrefixHash], at: usize| [&chain[..at], &unrelated[at..]].concat();
    let diverging = leaving(&conversations[3], 3000);
    // The same document with another question: nothing ends on its path below 4,096 pages.
    let same_document = leaving(&conversations[10], 4000);
    let mut group = c.benchmark_group("store lookup, 4096-page chain, 10000 snapshots");
    group.bench_function("full match", |b| {
        b.iter(|| black_box(store.lookup_longest(&conversations[5])))
    });
    group.bench_function("diverging at page 3000", |b| {
        b.iter(|| black_box(store.lookup_longest(&diverging)))
    });
    group.bench_function("miss", |b| {
        b.iter(|| black_box(store.lookup_longest(&unrelated)))
    });
    group.bench_function(
        "sharing 4000 pages with a lone snapshot (worst case)",
        |b| b.iter(|| black_box(store.lookup_longest(&same_document))),
    );
    group.finish();
}

/// A full store of `held` snapshots of `pages` pages; every save evicts exactly one.
fn save_under_pressure(c: &mut Criterion, held: usize, pages: usize) {
    let page_bytes = geometry().bytes_for_pages(pages);
    let chains: Vec<Vec<PrefixHash>> = (0..2 * held as u32)
        .map(|seed| hasher().chain(&tokens(seed + 1000, pages * PAGE_TOKENS)))
        .collect();
    let mut store = store(page_bytes * held as u64);
    for chain in &chains[..held] {
        save(&mut store, chain);
    }
    let mut next = held;
    let name = format!("store save evicting one, {held} held, {pages} pages each");
    c.bench_function(&name, |b| {
        b.iter(|| {
            let SaveStart::Reserved {
                reservation,
                evictions,
            } = store
                .begin_save(&chains[next % chains.len()], Tier::Device)
                .unwrap()
            else {
                panic!("every chain was evicted before it comes round again");
            };
            assert_eq!(evictions.len(), 1);
            next += 1;
            store.commit_save(reservation).unwrap()
        })
    });
}

fn pressure(c: &mut Criterion) {
    save_under_pressure(c, 10_000, 1);
    save_under_pressure(c, 10_000, 64);
    save_under_pressure(c, 1_000, 1024);
}

fn restore_and_hash(c: &mut Criterion) {
    let chain = hasher().chain(&tokens(7, 64 * PAGE_TOKENS));
    let mut store = store(u64::MAX);
    save(&mut store, &chain);
    let hit = store.lookup_longest(&chain).unwrap();
    let table: Vec<PageId> = (0..64).map(|page| PageId(page * 3)).collect();
    c.bench_function("store restore plan + unpin, 64 pages", |b| {
        b.iter(|| {
            black_box(
                store
                    .begin_restore(hit.snapshot, hit.pages, &table)
                    .unwrap(),
            );
            store.finish_restore(hit.snapshot).unwrap()
        })
    });
    let prompt = tokens(8, CHAIN_PAGES * PAGE_TOKENS);
    c.bench_function("prefix chain of 4096 pages (65536 tokens)", |b| {
        b.iter(|| black_box(hasher().chain(&prompt)))
    });
}

criterion_group!(benches, lookup, pressure, restore_and_hash);
criterion_main!(benches);
