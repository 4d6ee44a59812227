//! Invariants of the pool and the store under random operation sequences.
//!
//! Pool: free + used == total, no page owned twice, every owner agrees with its page table, a
//! table matches its token count, reservations never exceed the free list, and a worst-case
//! sequence never runs dry. Store: no tier over budget, charges equal the bytes of the
//! snapshots held, every pinned snapshot still present, every abort refunded to the byte, and
//! every lookup equal to a brute-force longest-prefix search. Frames: every consistent frame
//! round-trips, any input decodes without panicking, and any corruption of a frame is refused.

use std::collections::{HashMap, HashSet};

use cache::{
    CacheError, Eviction, FRAME_LEN, Frame, FrameKind, Generation, KvGeometry, PageId, PagePool,
    PoolConfig, PrefixHash, PrefixHasher, PrefixSalt, SaveReservation, SaveStart, SlotHandle,
    SlotId, SnapshotGeometry, SnapshotId, SnapshotState, SnapshotStore, Tier,
};
use policy::{ReservationPolicy, SnapshotConfig};
use proptest::prelude::*;

const PAGE_TOKENS: usize = 4;
const TOTAL_PAGES: u32 = 24;

#[derive(Debug, Clone)]
enum PoolOp {
    Admit { prompt: usize, max_new: usize },
    Extend { pick: usize, tokens: usize },
    Truncate { pick: usize, keep_percent: usize },
    Release { pick: usize },
    UseStale { pick: usize },
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        (0..40usize, 0..40usize).prop_map(|(prompt, max_new)| PoolOp::Admit { prompt, max_new }),
        (any::<usize>(), 0..24usize).prop_map(|(pick, tokens)| PoolOp::Extend { pick, tokens }),
        (any::<usize>(), 0..=100usize)
            .prop_map(|(pick, keep_percent)| PoolOp::Truncate { pick, keep_percent }),
        any::<usize>().prop_map(|pick| PoolOp::Release { pick }),
        any::<usize>().prop_map(|pick| PoolOp::UseStale { pick }),
    ]
}

/// A handle and the limit it was admitted with.
struct Live {
    handle: SlotHandle,
    limit_tokens: usize,
}

fn check_pool(pool: &PagePool, live: &[Live]) {
    let stats = pool.stats();
    assert_eq!(stats.free_pages + stats.used_pages, stats.total_pages);
    assert!(
        stats.reserved_pages <= stats.free_pages,
        "promised pages are free pages"
    );
    let mut owned = HashSet::new();
    for (handle, table) in pool.open_slots() {
        let tokens = pool.tokens(handle).unwrap();
        assert_eq!(table.len(), tokens.div_ceil(PAGE_TOKENS));
        for &page in table {
            assert!(owned.insert(page), "{page:?} owned twice");
            assert_eq!(pool.page_owner(page), Some(handle));
        }
    }
    assert_eq!(owned.len(), stats.used_pages);
    let unowned = (0..TOTAL_PAGES)
        .filter(|&p| pool.page_owner(PageId(p)).is_none())
        .count();
    assert_eq!(unowned, stats.free_pages);
    assert_eq!(pool.open_slots().count(), live.len());
}

fn apply_pool_op(
    pool: &mut PagePool,
    live: &mut Vec<Live>,
    dead: &mut Vec<SlotHandle>,
    op: PoolOp,
) {
    let worst_case = pool.config().reservation == ReservationPolicy::WorstCase;
    let pick = |pick: usize, len: usize| (len > 0).then(|| pick % len);
    match op {
        PoolOp::Admit { prompt, max_new } => {
            if let Ok(handle) = pool.admit(prompt, max_new) {
                live.push(Live {
                    handle,
                    limit_tokens: prompt + max_new,
                });
            }
        }
        PoolOp::Extend { pick: p, tokens } => {
            let Some(i) = pick(p, live.len()) else { return };
            let Live {
                handle,
                limit_tokens,
            } = live[i];
            let within_limit = pool.tokens(handle).unwrap() + tokens <= limit_tokens;
            let result = pool.extend(handle, tokens).map(|_| ());
            if worst_case && within_limit {
                assert_eq!(result, Ok(()), "a worst-case reservation never runs dry");
            }
        }
        PoolOp::Truncate {
            pick: p,
            keep_percent,
        } => {
            let Some(i) = pick(p, live.len()) else { return };
            let tokens = pool.tokens(live[i].handle).unwrap();
            pool.truncate(live[i].handle, tokens * keep_percent / 100)
                .unwrap();
        }
        PoolOp::Release { pick: p } => {
            let Some(i) = pick(p, live.len()) else { return };
            let gone = live.swap_remove(i).handle;
            pool.release(gone).unwrap();
            dead.push(gone);
        }
        PoolOp::UseStale { pick: p } => {
            let Some(i) = pick(p, dead.len()) else { return };
            let stale = Err(CacheError::StaleSlot { handle: dead[i] });
            assert_eq!(pool.extend(dead[i], 1).map(|_| ()), stale);
            assert_eq!(pool.release(dead[i]).map(|_| ()), stale);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_pool_never_loses_or_shares_a_page(
        worst_case in any::<bool>(),
        ops in proptest::collection::vec(pool_op(), 1..120),
    ) {
        let reservation = if worst_case { ReservationPolicy::WorstCase } else { ReservationPolicy::Optimistic };
        let config = PoolConfig { total_pages: TOTAL_PAGES, page_tokens: PAGE_TOKENS, max_slots: 5, reservation };
        let mut pool = PagePool::new(config);
        let (mut live, mut dead) = (Vec::new(), Vec::new());
        for op in ops {
            apply_pool_op(&mut pool, &mut live, &mut dead, op);
            check_pool(&pool, &live);
        }
    }
}

// The store: 8 bytes a page; the device tier holds 60 pages, the host 30; demotion on.

const PAGE_BYTES: u64 = 8;

/// K and V of one 1-byte element per token: 2 bytes a token, 8 a page.
fn geometry() -> SnapshotGeometry {
    let kv = KvGeometry {
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
        page_tokens: PAGE_TOKENS,
        dtype_bytes: 1,
    };
    SnapshotGeometry {
        kv,
        fixed_state_bytes: 0,
    }
}

#[derive(Debug, Clone)]
enum StoreOp {
    /// `finish`: 0 commit, 1 abort, 2 leave pending.
    Save {
        pages: Vec<u32>,
        host: bool,
        finish: u8,
    },
    FinishPending {
        pick: usize,
        commit: bool,
    },
    FinishDemotion {
        pick: usize,
        commit: bool,
    },
    Lookup {
        pages: Vec<u32>,
    },
    Restore {
        pick: usize,
    },
    Unpin {
        pick: usize,
    },
    Discard {
        pick: usize,
    },
}

/// A prefix of one of three conversations, optionally leaving it at some page: chains share
/// long prefixes, cross the index's stride boundaries, and sometimes exceed the budget.
fn pages() -> impl Strategy<Value = Vec<u32>> {
    (0..3u32, 0..=70usize, proptest::option::of(0..70usize)).prop_map(
        |(conversation, len, leave_at)| {
            (0..len as u32)
                .map(|page| match leave_at {
                    Some(at) if page as usize >= at => 9_000 + page,
                    _ => conversation * 100 + page,
                })
                .collect()
        },
    )
}

fn store_op() -> impl Strategy<Value = StoreOp> {
    prop_oneof![
        4 => (pages(), any::<bool>(), 0..3u8).prop_map(|(pages, host, finish)| StoreOp::Save { pages, host, finish }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, commit)| StoreOp::FinishPending { pick, commit }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, commit)| StoreOp::FinishDemotion { pick, commit }),
        3 => pages().prop_map(|pages| StoreOp::Lookup { pages }),
        2 => any::<usize>().prop_map(|pick| StoreOp::Restore { pick }),
        2 => any::<usize>().prop_map(|pick| StoreOp::Unpin { pick }),
        1 => any::<usize>().prop_map(|pick| StoreOp::Discard { pick }),
    ]
}

/// What the test knows independently of the store.
#[derive(Default)]
struct Model {
    /// Chains of every snapshot the store holds, in any state.
    chains: HashMap<SnapshotId, Vec<PrefixHash>>,
    findable: HashSet<SnapshotId>,
    pending: Vec<SaveReservation>,
    demoting: Vec<SnapshotId>,
    pins: HashMap<SnapshotId, u32>,
}

impl Model {
    fn pick_findable(&self, pick: usize) -> Option<SnapshotId> {
        let mut ids: Vec<_> = self.findable.iter().copied().collect();
        ids.sort();
        (!ids.is_empty()).then(|| ids[pick % ids.len()])
    }

    /// The longest prefix of `query` a findable snapshot covers: all of it, or any head it
    /// shares with `query`.
    fn longest(&self, query: &[PrefixHash]) -> Option<usize> {
        self.findable
            .iter()
            .map(|id| &self.chains[id])
            .map(|chain| chain.iter().zip(query).take_while(|(a, b)| a == b).count())
            .filter(|&shared| shared > 0)
            .max()
    }

    fn apply_evictions(&mut self, evictions: &[Eviction]) {
        for eviction in evictions {
            assert!(
                !self.pins.contains_key(&eviction.snapshot),
                "a pinned snapshot was evicted"
            );
            if eviction.demoted_to.is_some() {
                // Still found, and restored from its device copy, until the copy lands.
                self.demoting.push(eviction.snapshot);
            } else {
                self.findable.remove(&eviction.snapshot);
                self.chains.remove(&eviction.snapshot);
            }
        }
    }
}

fn hasher() -> PrefixHasher {
    PrefixHasher::new(PrefixSalt::new("properties", None), PAGE_TOKENS)
}

fn chain_of(pages: &[u32]) -> Vec<PrefixHash> {
    let tokens: Vec<u32> = pages.iter().flat_map(|&page| [page; PAGE_TOKENS]).collect();
    hasher().chain(&tokens)
}

fn save(store: &mut SnapshotStore, model: &mut Model, pages: &[u32], tier: Tier, finish: u8) {
    let chain = chain_of(pages);
    let Ok(SaveStart::Reserved {
        reservation,
        evictions,
    }) = store.begin_save(&chain, tier)
    else {
        return;
    };
    assert_eq!(reservation.bytes(), PAGE_BYTES * chain.len() as u64);
    model.apply_evictions(&evictions);
    model.chains.insert(reservation.snapshot(), chain);
    match finish {
        0 => {
            model
                .findable
                .insert(store.commit_save(reservation).unwrap());
        }
        1 => abort(store, model, reservation),
        _ => model.pending.push(reservation),
    }
}

fn abort(store: &mut SnapshotStore, model: &mut Model, reservation: SaveReservation) {
    let (id, tier, bytes) = (
        reservation.snapshot(),
        reservation.tier(),
        reservation.bytes(),
    );
    let charged = |store: &SnapshotStore| match tier {
        Tier::Device => store.stats().device.charged_bytes,
        Tier::Host => store.stats().host.charged_bytes,
        Tier::Disk => store.stats().disk.charged_bytes,
    };
    let before = charged(store);
    store.abort_save(reservation).unwrap();
    assert_eq!(
        charged(store),
        before - bytes,
        "an abort refunds its charge exactly"
    );
    assert_eq!(
        store.info(id),
        Err(CacheError::UnknownSnapshot { snapshot: id })
    );
    model.chains.remove(&id);
}

fn apply_store_op(store: &mut SnapshotStore, model: &mut Model, op: StoreOp) {
    match op {
        StoreOp::Save {
            pages,
            host,
            finish,
        } => save(
            store,
            model,
            &pages,
            if host { Tier::Host } else { Tier::Device },
            finish,
        ),
        StoreOp::FinishPending { pick, commit } => {
            if model.pending.is_empty() {
                return;
            }
            let reservation = model.pending.swap_remove(pick % model.pending.len());
            if commit {
                model
                    .findable
                    .insert(store.commit_save(reservation).unwrap());
            } else {
                abort(store, model, reservation);
            }
        }
        StoreOp::FinishDemotion { pick, commit } => {
            if model.demoting.is_empty() {
                return;
            }
            let id = model.demoting.swap_remove(pick % model.demoting.len());
            if commit {
                store.commit_demotion(id).unwrap();
            } else {
                // The engine releases a restore's pin before it reports the demotion failed.
                if model.pins.contains_key(&id) {
                    model.demoting.push(id);
                    return;
                }
                store.abort_demotion(id).unwrap();
                model.findable.remove(&id);
                model.chains.remove(&id);
            }
        }
        StoreOp::Lookup { pages } => {
            let query = chain_of(&pages);
            let found = store.lookup_longest(&query).map(|hit| hit.pages);
            assert_eq!(found, model.longest(&query));
        }
        StoreOp::Restore { pick } => {
            let Some(id) = model.pick_findable(pick) else {
                return;
            };
            let table: Vec<PageId> = (0..70).map(PageId).collect();
            store
                .begin_restore(id, model.chains[&id].len(), &table)
                .unwrap();
            *model.pins.entry(id).or_default() += 1;
        }
        StoreOp::Unpin { pick } => {
            let mut pinned: Vec<_> = model.pins.keys().copied().collect();
            pinned.sort();
            let Some(&id) = pinned.get(pick % pinned.len().max(1)) else {
                return;
            };
            store.finish_restore(id).unwrap();
            let pins = model.pins.get_mut(&id).unwrap();
            *pins -= 1;
            if *pins == 0 {
                model.pins.remove(&id);
            }
        }
        StoreOp::Discard { pick } => {
            let Some(id) = model.pick_findable(pick) else {
                return;
            };
            let result = store.discard(id);
            if model.demoting.contains(&id) {
                assert!(
                    matches!(result, Err(CacheError::WrongState { .. })),
                    "{result:?}"
                );
            } else if model.pins.contains_key(&id) {
                assert_eq!(result, Err(CacheError::Pinned { snapshot: id }));
            } else {
                result.unwrap();
                model.findable.remove(&id);
                model.chains.remove(&id);
            }
        }
    }
}

fn check_store(store: &SnapshotStore, model: &Model) {
    let stats = store.stats();
    let mut charged = [0u64; 2];
    let mut ids: Vec<_> = store.snapshot_ids().collect();
    ids.sort();
    let mut expected: Vec<_> = model.chains.keys().copied().collect();
    expected.sort();
    assert_eq!(
        ids, expected,
        "the store holds exactly what the model expects"
    );
    for id in ids {
        let info = store.info(id).unwrap();
        charged[matches!(info.tier, Tier::Host) as usize] += info.bytes;
        assert_eq!(info.pins, model.pins.get(&id).copied().unwrap_or(0));
        let published = matches!(info.state, SnapshotState::Ready | SnapshotState::Demoting);
        assert_eq!(published, model.findable.contains(&id));
        assert_eq!(
            info.state == SnapshotState::Demoting,
            model.demoting.contains(&id)
        );
        assert_eq!(info.demoting_from.is_some(), model.demoting.contains(&id));
    }
    for (tier, tier_charged) in [(stats.device, charged[0]), (stats.host, charged[1])] {
        assert!(
            tier.charged_bytes <= tier.budget_bytes,
            "over budget: {tier:?}"
        );
        assert_eq!(
            tier.charged_bytes, tier_charged,
            "charges are the bytes held"
        );
    }
    for id in model.pins.keys() {
        let state = store.info(*id).map(|info| info.state);
        assert!(
            matches!(state, Ok(SnapshotState::Ready | SnapshotState::Demoting)),
            "pinned and present: {state:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_store_keeps_its_budget_pins_and_refunds(ops in proptest::collection::vec(store_op(), 1..150)) {
        let config = SnapshotConfig {
            device_budget_bytes: 60 * PAGE_BYTES,
            host_budget_bytes: 30 * PAGE_BYTES,
            demote_to_host: true,
            ..Default::default()
        };
        let mut store = SnapshotStore::new(geometry(), &config.validate().unwrap());
        let mut model = Model::default();
        for op in ops {
            apply_store_op(&mut store, &mut model, op);
            check_store(&store, &model);
        }
    }
}

// Frames.

fn any_frame() -> impl Strategy<Value = Frame> {
    let dims = (
        1..100usize,
        1..16usize,
        1..256usize,
        0..8u32,
        prop_oneof![Just(1usize), Just(2), Just(4)],
    );
    let place = (
        any::<bool>(),
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        0..1000u64,
        0..1000u64,
        any::<u32>(),
    );
    (dims, place).prop_map(
        |((layers, kv_heads, head_dim, page_shift, dtype_bytes), place)| {
            let (save, snapshot, slot, generation, pages, fixed_state_bytes, crc) = place;
            let kv = KvGeometry {
                layers,
                kv_heads,
                head_dim,
                page_tokens: 1 << page_shift,
                dtype_bytes,
            };
            let geometry = SnapshotGeometry {
                kv,
                fixed_state_bytes,
            };
            let kind = if save {
                FrameKind::Save
            } else {
                FrameKind::Restore
            };
            let slot = SlotHandle {
                slot: SlotId(slot),
                generation: Generation(generation),
            };
            let tokens = pages * kv.page_tokens as u64;
            let bytes = geometry.bytes_for_pages(pages as usize);
            Frame::new(
                kind,
                SnapshotId(snapshot),
                slot,
                tokens,
                bytes,
                crc,
                geometry,
            )
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn every_consistent_frame_round_trips(frame in any_frame()) {
        prop_assert_eq!(Frame::decode(&frame.encode().unwrap()), Ok(frame));
    }

    #[test]
    fn any_input_decodes_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..2 * FRAME_LEN)) {
        let _ = Frame::decode(&bytes);
    }

    #[test]
    fn any_corruption_of_a_frame_is_refused(
        frame in any_frame(),
        edits in proptest::collection::vec((0..FRAME_LEN, 1..=255u8), 1..6),
    ) {
        let mut bytes = frame.encode().unwrap();
        for (at, flip) in edits {
            bytes[at] ^= flip;
        }
        let unchanged = bytes == frame.encode().unwrap();
        prop_assert_eq!(Frame::decode(&bytes).is_ok(), unchanged);
    }
}
