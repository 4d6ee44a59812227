//! Tiny stores with exact expectations: 10 bytes per page, a 50-byte device tier.

use policy::SnapshotConfig;

use super::*;
use crate::geometry::KvGeometry;
use crate::ids::{Generation, SlotId};
use crate::prefix::{PrefixHasher, PrefixSalt};

const PAGE_TOKENS: usize = 5;

/// 5 tokens of 2 bytes (1 layer, 1 head, dim 1, 1-byte K and V) per page: 10 bytes a page.
fn geometry(fixed_state_bytes: u64) -> SnapshotGeometry {
    let kv = KvGeometry {
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
        page_tokens: PAGE_TOKENS,
        dtype_bytes: 1,
    };
    SnapshotGeometry {
        kv,
        fixed_state_bytes,
    }
}

fn store_with(host_budget_bytes: u64, demote_to_host: bool) -> SnapshotStore {
    let config = SnapshotConfig {
        device_budget_bytes: 50,
        host_budget_bytes,
        demote_to_host,
        ..Default::default()
    };
    SnapshotStore::new(
        geometry(0),
        &config.validate().expect("valid snapshot config"),
    )
}

fn store() -> SnapshotStore {
    store_with(0, false)
}

fn roomy_store() -> SnapshotStore {
    let config = SnapshotConfig {
        device_budget_bytes: 10_000,
        ..Default::default()
    };
    SnapshotStore::new(geometry(0), &config.validate().unwrap())
}

/// The first `len` pages of a conversation, then `tail` pages that leave it.
fn conversation(len: usize, tail: usize) -> Vec<u32> {
    (0..len as u32)
        .chain((0..tail as u32).map(|page| 1_000 + page))
        .collect()
}

/// The chain of a prompt whose page `i` is `pages[i]` repeated.
fn chain(pages: &[u32]) -> Vec<PrefixHash> {
    let tokens: Vec<u32> = pages.iter().flat_map(|&page| [page; PAGE_TOKENS]).collect();
    PrefixHasher::new(PrefixSalt::new("test", None), PAGE_TOKENS).chain(&tokens)
}

fn reserve(
    store: &mut SnapshotStore,
    pages: &[u32],
    tier: Tier,
) -> (SaveReservation, Vec<Eviction>) {
    match store
        .begin_save(&chain(pages), tier)
        .expect("the save fits")
    {
        SaveStart::Reserved {
            reservation,
            evictions,
        } => (reservation, evictions),
        SaveStart::AlreadyStored(id) => panic!("{pages:?} is already stored as {id}"),
        SaveStart::NotSeenEnough => unreachable!("begin_save saves whatever it is given"),
    }
}

/// Saves and commits on the device tier; returns the snapshot and the ids it evicted.
fn save(store: &mut SnapshotStore, pages: &[u32]) -> (SnapshotId, Vec<SnapshotId>) {
    let (reservation, evictions) = reserve(store, pages, Tier::Device);
    let id = store
        .commit_save(reservation)
        .expect("a fresh reservation commits");
    (id, evictions.iter().map(|e| e.snapshot).collect())
}

fn hit(store: &mut SnapshotStore, pages: &[u32]) -> Option<SnapshotId> {
    store.lookup_longest(&chain(pages)).map(|hit| hit.snapshot)
}

fn state(store: &SnapshotStore, id: SnapshotId) -> Option<SnapshotState> {
    store.info(id).ok().map(|info| info.state)
}

#[test]
fn a_save_is_charged_from_the_geometry_before_it_is_published() {
    let mut store = store();
    let (reservation, evictions) = reserve(&mut store, &[1, 2, 3], Tier::Device);
    assert_eq!(
        (reservation.bytes(), reservation.tokens(), evictions.len()),
        (30, 15, 0)
    );
    assert_eq!(store.stats().device.charged_bytes, 30);
    assert_eq!(hit(&mut store, &[1, 2, 3]), None, "unpublished");
    let id = store.commit_save(reservation).unwrap();
    let found = store.lookup_longest(&chain(&[1, 2, 3, 4])).unwrap();
    assert_eq!(
        found,
        LookupHit {
            snapshot: id,
            tokens: 15,
            pages: 3,
            tier: Tier::Device
        }
    );
}

#[test]
fn fixed_state_bytes_are_charged_with_the_pages() {
    let config = SnapshotConfig {
        device_budget_bytes: 100,
        ..Default::default()
    };
    let mut store = SnapshotStore::new(geometry(7), &config.validate().unwrap());
    let (reservation, _) = reserve(&mut store, &[1, 2], Tier::Device);
    assert_eq!(reservation.bytes(), 2 * 10 + 7);
    assert_eq!(store.stats().device.charged_bytes, 27);
}

#[test]
fn eviction_takes_the_least_recently_used_first_in_exact_order() {
    let mut store = store();
    let ids: Vec<SnapshotId> = (1..=5).map(|page| save(&mut store, &[page]).0).collect();
    let [a, b, c, d, e] = ids[..] else {
        unreachable!()
    };
    assert_eq!(hit(&mut store, &[1, 7]), Some(a));
    let (f, evicted) = save(&mut store, &[6]);
    assert_eq!(evicted, vec![b]);
    let (g, evicted) = save(&mut store, &[7, 7]);
    assert_eq!(evicted, vec![c, d]);
    assert_eq!(store.eviction_order(Tier::Device), vec![e, a, f, g]);
    assert_eq!(store.stats().device.charged_bytes, 50);
    assert_eq!(store.stats().evictions, 3);
}

#[test]
fn a_short_recently_used_snapshot_is_not_evicted_before_an_older_one_covering_it() {
    // Seed 002: an older covering snapshot made a recently reused short one the victim.
    let mut store = store();
    let (short, _) = save(&mut store, &[1]);
    let (long, _) = save(&mut store, &[1, 2, 3]);
    assert_eq!(
        hit(&mut store, &[1, 9, 9]),
        Some(short),
        "only the short one matches"
    );
    let (_, evicted) = save(&mut store, &[4, 4]);
    assert_eq!(evicted, vec![long]);
    assert_eq!(state(&store, short), Some(SnapshotState::Ready));
}

#[test]
fn lookup_prefers_the_longest_snapshot_whose_every_page_matches() {
    let mut store = store();
    let (short, _) = save(&mut store, &[1]);
    let (long, _) = save(&mut store, &[1, 2, 3]);
    assert_eq!(hit(&mut store, &[1, 2, 3, 4]), Some(long));
    assert_eq!(hit(&mut store, &[1, 2, 3]), Some(long));
    assert_eq!(
        hit(&mut store, &[1, 2]),
        Some(long),
        "two pages of the long one beat the whole short one"
    );
    assert_eq!(hit(&mut store, &[1, 2, 4]), Some(long));
    assert_eq!(
        hit(&mut store, &[1, 5]),
        Some(short),
        "a whole match wins a tie"
    );
    assert_eq!(
        store.lookup_longest(&chain(&[1, 2, 4])).map(|h| h.pages),
        Some(2)
    );
    assert_eq!(hit(&mut store, &[2, 1]), None);
    assert_eq!(hit(&mut store, &[]), None);
    let stats = store.stats();
    assert_eq!((stats.hits, stats.misses), (6, 2));
}

#[test]
fn a_failed_save_refunds_its_charge_and_publishes_nothing() {
    let mut store = store();
    let (kept, _) = save(&mut store, &[9]);
    let (reservation, _) = reserve(&mut store, &[1, 2, 3], Tier::Device);
    let failed = reservation.snapshot();
    store.abort_save(reservation).unwrap();
    let stats = store.stats();
    assert_eq!(
        (
            stats.device.charged_bytes,
            stats.device.snapshots,
            stats.saves_aborted
        ),
        (10, 1, 1)
    );
    assert_eq!(
        store.info(failed),
        Err(CacheError::UnknownSnapshot { snapshot: failed })
    );
    assert_eq!(hit(&mut store, &[1, 2, 3]), None);
    assert_eq!(store.snapshot_ids().collect::<Vec<_>>(), vec![kept]);
    let (again, _) = reserve(&mut store, &[1, 2, 3], Tier::Device);
    assert_ne!(again.snapshot(), failed, "ids are never reused");
    store.abort_save(again).unwrap();
    assert_eq!(
        store.index.sizes(),
        (1, 1, 1),
        "only the kept snapshot is indexed"
    );
}

#[test]
fn a_pinned_snapshot_survives_pressure_that_evicts_everything_else() {
    let mut store = store();
    let [a, b, c, d] = [1, 2, 3, 4].map(|page| save(&mut store, &[page]).0);
    store.begin_restore(b, 1, &[PageId(0)]).unwrap();
    let (x, evicted) = save(&mut store, &[5, 5, 5, 5]);
    assert_eq!(evicted, vec![a, c, d]);
    let refused = store.begin_save(&chain(&[6, 6, 6, 6, 6]), Tier::Device);
    assert_eq!(
        refused,
        Err(CacheError::OverBudget {
            tier: Tier::Device,
            needed_bytes: 50,
            reclaimable_bytes: 40
        })
    );
    assert_eq!(
        state(&store, x),
        Some(SnapshotState::Ready),
        "a refusal evicts nothing"
    );
    assert_eq!(state(&store, b), Some(SnapshotState::Ready));
    store.finish_restore(b).unwrap();
    let (_, evicted) = save(&mut store, &[6, 6, 6, 6, 6]);
    assert_eq!(evicted, vec![b, x], "b's restore was before x's save");
    assert_eq!(store.stats().refusals, 1);
}

#[test]
fn a_snapshot_larger_than_the_tier_is_refused_having_evicted_nothing() {
    let mut store = store();
    let (a, _) = save(&mut store, &[1]);
    let refused = store.begin_save(&chain(&[1, 2, 3, 4, 5, 6]), Tier::Device);
    assert_eq!(
        refused,
        Err(CacheError::SnapshotTooLarge {
            tier: Tier::Device,
            bytes: 60,
            budget_bytes: 50
        })
    );
    assert_eq!(state(&store, a), Some(SnapshotState::Ready));
    assert_eq!(
        store.begin_save(&[], Tier::Device),
        Err(CacheError::EmptyPrefix)
    );
}

#[test]
fn a_snapshot_being_saved_is_neither_found_nor_evicted() {
    let mut store = store();
    let (pending, _) = reserve(&mut store, &[1, 2, 3, 4, 5], Tier::Device);
    let refused = store.begin_save(&chain(&[7]), Tier::Device);
    assert!(matches!(
        refused,
        Err(CacheError::OverBudget {
            reclaimable_bytes: 0,
            ..
        })
    ));
    assert_eq!(hit(&mut store, &[1, 2, 3, 4, 5]), None);
    store.commit_save(pending).unwrap();
}

#[test]
fn saving_a_stored_prefix_again_refreshes_it_and_charges_nothing() {
    let mut store = store();
    let (a, _) = save(&mut store, &[1]);
    let (b, _) = save(&mut store, &[2]);
    assert_eq!(
        store.begin_save(&chain(&[1]), Tier::Device),
        Ok(SaveStart::AlreadyStored(a))
    );
    assert_eq!(store.eviction_order(Tier::Device), vec![b, a]);
    assert_eq!(store.stats().device.charged_bytes, 20);
}

#[test]
fn an_evicted_device_snapshot_is_demoted_when_the_host_has_room() {
    let mut store = store_with(20, true);
    let [a, b, c, _, _] = [1, 2, 3, 4, 5].map(|page| save(&mut store, &[page]).0);
    let (_, evictions) = reserve(&mut store, &[6], Tier::Device);
    let to = evictions[0].demoted_to.expect("the host has room");
    assert_eq!(
        evictions,
        vec![Eviction {
            snapshot: a,
            from: Tier::Device,
            backing: BackingId(1),
            bytes: 10,
            demoted_to: Some(to),
            demoted_tier: Tier::Host,
        }]
    );
    assert_eq!(state(&store, a), Some(SnapshotState::Demoting));
    // Until the copy lands it is found, and restored from its device copy.
    let found = store
        .lookup_longest(&chain(&[1]))
        .expect("found while demoting");
    assert_eq!((found.snapshot, found.tier), (a, Tier::Device));
    let plan = store.begin_restore(a, 1, &[PageId(0)]).unwrap();
    assert_eq!((plan.backing, plan.tier), (BackingId(1), Tier::Device));
    assert_eq!(store.info(a).unwrap().demoting_from, Some(BackingId(1)));
    store.commit_demotion(a).unwrap();
    store.finish_restore(a).unwrap();
    assert_eq!(store.info(a).unwrap().demoting_from, None);
    assert_eq!(
        store
            .lookup_longest(&chain(&[1]))
            .map(|h| (h.snapshot, h.tier)),
        Some((a, Tier::Host))
    );
    let (_, evictions) = reserve(&mut store, &[7], Tier::Device);
    assert_eq!(
        (evictions[0].snapshot, evictions[0].demoted_to.is_some()),
        (b, true)
    );
    store.commit_demotion(b).unwrap();
    assert_eq!(
        store.eviction_order(Tier::Host),
        vec![b, a],
        "b's last use predates a's lookup"
    );
    let (_, evictions) = reserve(&mut store, &[8], Tier::Device);
    assert_eq!(
        (evictions[0].snapshot, evictions[0].demoted_to),
        (c, None),
        "the host is full"
    );
    assert_eq!(state(&store, c), None);
    let stats = store.stats();
    assert_eq!(
        (stats.host.charged_bytes, stats.demotions, stats.evictions),
        (20, 2, 3)
    );
    assert_eq!(
        store.begin_restore(a, 1, &[PageId(3)]).unwrap().tier,
        Tier::Host
    );
}

#[test]
fn a_failed_demotion_leaves_no_trace() {
    let mut store = store_with(20, true);
    let [a, ..] = [1, 2, 3, 4, 5].map(|page| save(&mut store, &[page]).0);
    let _ = reserve(&mut store, &[6], Tier::Device);
    store.abort_demotion(a).unwrap();
    assert_eq!(state(&store, a), None);
    assert_eq!(store.stats().host.charged_bytes, 0);
    assert_eq!(hit(&mut store, &[1]), None);
    assert!(matches!(
        store.commit_demotion(a),
        Err(CacheError::UnknownSnapshot { .. })
    ));
}

#[test]
fn a_corrupt_snapshot_is_dropped_once_unpinned_kept_or_not() {
    let mut store = roomy_store();
    let (a, _) = save(&mut store, &[1, 2]);
    store.keep(a).unwrap();
    let plan = store.begin_restore(a, 2, &[PageId(0), PageId(1)]).unwrap();
    assert_eq!(
        plan.prefix,
        chain(&[1, 2])[1],
        "the restore names its last page's hash"
    );
    assert!(matches!(
        store.drop_corrupt(a),
        Err(CacheError::Pinned { .. })
    ));
    store.finish_restore(a).unwrap();
    let freed = store.drop_corrupt(a).unwrap();
    assert_eq!(
        freed,
        vec![Eviction {
            snapshot: a,
            from: Tier::Device,
            backing: plan.backing,
            bytes: 20,
            demoted_to: None,
            demoted_tier: Tier::Device,
        }]
    );
    assert_eq!(state(&store, a), None);
    assert_eq!(hit(&mut store, &[1, 2]), None);
    let stats = store.stats();
    assert_eq!((stats.device.charged_bytes, stats.corrupt), (0, 1));
}

#[test]
fn a_demoting_snapshot_found_corrupt_is_never_found_again_and_dropped_when_its_copy_lands() {
    let mut store = store_with(20, true);
    let [a, ..] = [1, 2, 3, 4, 5].map(|page| save(&mut store, &[page]).0);
    let (_, evictions) = reserve(&mut store, &[6], Tier::Device);
    let to = evictions[0].demoted_to.unwrap();
    assert_eq!(store.drop_corrupt(a).unwrap(), vec![]);
    assert_eq!(hit(&mut store, &[1]), None, "never restored again");
    let freed = store.commit_demotion(a).unwrap();
    assert_eq!(
        freed
            .iter()
            .map(|e| (e.snapshot, e.backing))
            .collect::<Vec<_>>(),
        vec![(a, to)],
        "its host copy is freed"
    );
    assert_eq!(state(&store, a), None);
    assert_eq!(store.stats().host.charged_bytes, 0);
}

#[test]
fn without_demotion_the_host_tier_takes_direct_saves() {
    let mut store = store_with(30, false);
    let (reservation, _) = reserve(&mut store, &[1, 2], Tier::Host);
    let id = store.commit_save(reservation).unwrap();
    assert_eq!(store.stats().host.charged_bytes, 20);
    assert_eq!(
        store.lookup_longest(&chain(&[1, 2])).map(|h| h.tier),
        Some(Tier::Host)
    );
    let (_, evictions) = reserve(&mut store, &[3, 3], Tier::Host);
    assert_eq!((evictions[0].snapshot, evictions[0].demoted_to), (id, None));
}

#[test]
fn restore_plans_map_snapshot_rows_to_the_pages_given_same_base_or_relocated() {
    let mut store = store();
    let saved_from = [PageId(4), PageId(5), PageId(6), PageId(2)];
    let (reservation, _) = reserve(&mut store, &[1, 2, 3], Tier::Device);
    let rows = |copies: &[PageCopy]| {
        copies
            .iter()
            .map(|c| (c.snapshot_page, c.pool_page.0))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        rows(&reservation.copies(&saved_from).unwrap()),
        vec![(0, 4), (1, 5), (2, 6)]
    );
    let id = store.commit_save(reservation).unwrap();
    let same_base = store.begin_restore(id, 3, &saved_from).unwrap();
    assert_eq!(rows(&same_base.copies), vec![(0, 4), (1, 5), (2, 6)]);
    assert_eq!(
        (same_base.tokens, same_base.bytes, same_base.backing),
        (15, 30, BackingId(1))
    );
    let relocated = store
        .begin_restore(id, 3, &[PageId(9), PageId(0), PageId(7)])
        .unwrap();
    assert_eq!(rows(&relocated.copies), vec![(0, 9), (1, 0), (2, 7)]);
    let short = store.begin_restore(id, 3, &[PageId(9)]);
    assert_eq!(
        short,
        Err(CacheError::ShortPageTable {
            snapshot_pages: 3,
            table_pages: 1
        })
    );
    assert_eq!(
        store.info(id).unwrap().pins,
        2,
        "a refused restore pins nothing"
    );
}

#[test]
fn a_restore_pins_until_it_is_finished() {
    let mut store = store();
    let (id, _) = save(&mut store, &[1]);
    store.begin_restore(id, 1, &[PageId(0)]).unwrap();
    assert_eq!(store.discard(id), Err(CacheError::Pinned { snapshot: id }));
    store.finish_restore(id).unwrap();
    assert_eq!(
        store.finish_restore(id),
        Err(CacheError::NotPinned { snapshot: id })
    );
    assert_eq!(store.discard(id), Ok(BackingId(1)));
    assert_eq!(store.stats().device.charged_bytes, 0);
    assert_eq!(store.index.sizes(), (0, 0, 0));
}

#[test]
fn a_reservation_is_committed_once_and_frames_describe_it() {
    let mut store = store();
    let (reservation, _) = reserve(&mut store, &[1, 2], Tier::Device);
    let slot = SlotHandle {
        slot: SlotId(2),
        generation: Generation(5),
    };
    let frame = reservation.frame(slot, 0xabcd);
    assert_eq!(
        (
            frame.kind,
            frame.slot,
            frame.position_tokens,
            frame.byte_len
        ),
        (FrameKind::Save, slot, 10, 20)
    );
    frame.validate().unwrap();
    let id = store.commit_save(reservation).unwrap();
    let plan = store.begin_restore(id, 2, &[PageId(1), PageId(2)]).unwrap();
    let frame = plan.frame(slot, 0xabcd);
    assert_eq!(
        (frame.kind, frame.snapshot, frame.byte_len),
        (FrameKind::Restore, id, 20)
    );
    assert!(matches!(
        store.commit_save(SaveReservation {
            snapshot: id,
            backing: BackingId(1),
            tier: Tier::Device,
            pages: 2,
            bytes: 20,
            geometry: geometry(0)
        }),
        Err(CacheError::WrongState {
            expected: SnapshotState::Saving,
            found: SnapshotState::Ready,
            ..
        })
    ));
}

#[test]
fn lookup_finds_the_longest_match_on_either_side_of_an_indexed_boundary() {
    // Whole snapshots, and heads of longer ones, on either side of a stride (16 pages).
    let mut store = roomy_store();
    let lengths = [3, 15, 16, 17, 32, 40];
    let ids: Vec<SnapshotId> = lengths
        .iter()
        .map(|&len| save(&mut store, &conversation(len, 0)).0)
        .collect();
    let pages_hit = |store: &mut SnapshotStore, query: &[u32]| {
        store.lookup_longest(&chain(query)).map(|h| h.pages)
    };
    for (shared, expected) in [
        (50, 40),
        (40, 40),
        (39, 39),
        (32, 32),
        (31, 31),
        (17, 17),
        (16, 16),
        (15, 15),
        (14, 14),
        (3, 3),
    ] {
        assert_eq!(
            pages_hit(&mut store, &conversation(shared, 5)),
            Some(expected),
            "sharing {shared}"
        );
        assert_eq!(
            pages_hit(&mut store, &conversation(shared, 0)),
            Some(expected),
            "ending at {shared}"
        );
    }
    assert_eq!(
        pages_hit(&mut store, &conversation(2, 30)),
        Some(2),
        "a head of 3"
    );
    assert_eq!(pages_hit(&mut store, &[9_999, 9_998]), None);
    for id in ids {
        store.discard(id).unwrap();
    }
    assert_eq!(store.index.sizes(), (0, 0, 0));
}

#[test]
fn the_store_and_the_pool_can_move_to_an_actor_thread() {
    fn send<T: Send>() {}
    send::<SnapshotStore>();
    send::<crate::pool::PagePool>();
    send::<SaveReservation>();
}

#[test]
fn a_query_sharing_a_stride_restores_the_head_of_a_longer_snapshot() {
    let mut store = roomy_store();
    let (long, _) = save(&mut store, &conversation(40, 0));
    // 20 pages in common, then another question.
    let hit = store.lookup_longest(&chain(&conversation(20, 7))).unwrap();
    assert_eq!(
        (hit.snapshot, hit.pages, hit.tokens),
        (long, 20, 20 * PAGE_TOKENS)
    );
    let table: Vec<PageId> = (0..20).map(|p| PageId(100 + p)).collect();
    let plan = store.begin_restore(long, hit.pages, &table).unwrap();
    assert_eq!(plan.copies.len(), 20);
    assert_eq!(
        (plan.copies[19].snapshot_page, plan.copies[19].pool_page),
        (19, PageId(119))
    );
    assert_eq!(plan.tokens, 20 * PAGE_TOKENS);
    assert_eq!(plan.bytes, store.geometry.bytes_for_pages(20));
    store.finish_restore(long).unwrap();
    // Fewer than a stride in common: the head is restored all the same.
    let hit = store.lookup_longest(&chain(&conversation(15, 7))).unwrap();
    assert_eq!((hit.snapshot, hit.pages), (long, 15));
    store.begin_restore(long, hit.pages, &table).unwrap();
    store.finish_restore(long).unwrap();
    // Not even the first page in common: nothing.
    assert_eq!(store.lookup_longest(&chain(&[77, 78])), None);
    assert_eq!(
        store.begin_restore(long, 41, &table),
        Err(CacheError::RestoreLength {
            snapshot: long,
            asked_pages: 41,
            snapshot_pages: 40
        })
    );
}

#[test]
fn snapshots_with_fixed_state_lend_no_heads() {
    let config = SnapshotConfig {
        device_budget_bytes: 100_000,
        ..Default::default()
    };
    let mut store = SnapshotStore::new(geometry(8), &config.validate().unwrap());
    let (long, _) = save(&mut store, &conversation(40, 0));
    assert_eq!(store.lookup_longest(&chain(&conversation(39, 2))), None);
    let table: Vec<PageId> = (0..40).map(PageId).collect();
    assert!(matches!(
        store.begin_restore(long, 20, &table),
        Err(CacheError::RestoreLength { .. })
    ));
    assert_eq!(
        store
            .lookup_longest(&chain(&conversation(40, 2)))
            .map(|h| h.pages),
        Some(40)
    );
}

/// The pages a prompt save reserved, or `None` when it saved nothing.
fn prompt_save(store: &mut SnapshotStore, pages: &[u32]) -> Option<usize> {
    match store
        .begin_prompt_save(&chain(pages), Tier::Device)
        .unwrap()
    {
        SaveStart::Reserved { reservation, .. } => {
            let saved = reservation.pages();
            store.commit_save(reservation).unwrap();
            Some(saved)
        }
        SaveStart::AlreadyStored(_) | SaveStart::NotSeenEnough => None,
    }
}

#[test]
fn a_prompt_is_saved_on_its_second_sighting_and_counted_when_skipped() {
    let mut store = roomy_store();
    store.set_save_after_sightings(2);
    let prompt = [1, 2, 3];
    assert_eq!(hit(&mut store, &prompt), None);
    assert_eq!(prompt_save(&mut store, &prompt), None, "seen once");
    assert_eq!(store.stats().saves_skipped, 1);
    assert_eq!(hit(&mut store, &prompt), None);
    assert_eq!(prompt_save(&mut store, &prompt), Some(3), "seen twice");
    assert!(hit(&mut store, &prompt).is_some());
    // At one sighting every prompt is saved, as before the policy existed.
    let mut eager = roomy_store();
    eager.set_save_after_sightings(1);
    assert_eq!(hit(&mut eager, &[9, 9]), None);
    assert_eq!(prompt_save(&mut eager, &[9, 9]), Some(2));
    assert_eq!(eager.stats().saves_skipped, 0);
}

#[test]
fn a_shared_opening_is_saved_up_to_the_stride_its_prompts_share() {
    let mut store = roomy_store();
    store.set_save_after_sightings(2);
    let first = conversation(20, 3);
    let second = conversation(20, 5);
    hit(&mut store, &first);
    assert_eq!(prompt_save(&mut store, &first), None);
    hit(&mut store, &second);
    // The two share 20 pages; the deepest recorded boundary inside them is page 16.
    assert_eq!(prompt_save(&mut store, &second), Some(16));
    let third = conversation(20, 7);
    let restored = store
        .lookup_longest(&chain(&third))
        .expect("the opening is stored");
    assert_eq!(restored.pages, 16);
}

#[test]
fn a_kept_snapshot_is_never_evicted_and_a_save_needing_its_room_is_refused() {
    // Five pages of budget: a kept three-page snapshot leaves two for the rest.
    let mut store = store();
    let kept = match store
        .begin_kept_save(&chain(&[1, 2, 3]), Tier::Device)
        .unwrap()
    {
        SaveStart::Reserved { reservation, .. } => store.commit_save(reservation).unwrap(),
        other => panic!("{other:?}"),
    };
    assert!(store.info(kept).unwrap().kept);
    let (a, _) = save(&mut store, &[4, 4]);
    let (_, evicted) = save(&mut store, &[5, 5]);
    assert_eq!(evicted, vec![a], "the unkept one goes, the kept one stays");
    assert!(matches!(
        store.begin_save(&chain(&[6, 6, 6]), Tier::Device),
        Err(CacheError::OverBudget { .. })
    ));
    assert_eq!(state(&store, kept), Some(SnapshotState::Ready));
    // Keeping what is already stored keeps that one; lookups count as its hits.
    let (b, _) = save(&mut store, &[7]);
    assert_eq!(
        store.begin_kept_save(&chain(&[7]), Tier::Device).unwrap(),
        SaveStart::AlreadyStored(b)
    );
    assert!(store.info(b).unwrap().kept);
    assert_eq!(hit(&mut store, &[1, 2, 3, 9]), Some(kept));
    assert_eq!(store.info(kept).unwrap().hits, 1);
    assert_eq!(
        store.stats().device.kept_bytes,
        40,
        "three pages and one, kept"
    );
    // Dropped on purpose, its bytes are refunded: [7] alone is left ([5, 5] made room for it).
    store.discard(kept).unwrap();
    assert_eq!(store.stats().device.kept_bytes, 10);
    assert_eq!(store.stats().device.charged_bytes, 10);
}

/// A device tier of 50 bytes, a host tier of `host` and a disk tier of `disk` bytes.
fn disk_store(host: u64, disk: u64) -> SnapshotStore {
    let config = SnapshotConfig {
        device_budget_bytes: 50,
        host_budget_bytes: host,
        demote_to_host: host > 0,
        disk_dir: Some("/nowhere".into()),
        disk_budget_bytes: disk,
        ..Default::default()
    };
    SnapshotStore::new(geometry(0), &config.validate().unwrap())
}

#[test]
fn evictions_flow_device_to_host_to_disk_and_the_disk_drops_its_oldest() {
    let mut store = disk_store(20, 20);
    let [a, b, c, d, e] = [1, 2, 3, 4, 5].map(|page| save(&mut store, &[page]).0);
    // a and b go to the host.
    for page in [10, 11] {
        let (reservation, evictions) = reserve(&mut store, &[page], Tier::Device);
        for eviction in &evictions {
            assert_eq!(eviction.demoted_tier, Tier::Host);
            store.commit_demotion(eviction.snapshot).unwrap();
        }
        store.commit_save(reservation).unwrap();
    }
    assert_eq!(store.eviction_order(Tier::Host), vec![a, b]);
    // c needs the host's room: a moves on to disk first, then c takes its place.
    let (_, evictions) = reserve(&mut store, &[20], Tier::Device);
    let moves: Vec<_> = evictions
        .iter()
        .map(|e| (e.snapshot, e.from, e.demoted_tier))
        .collect();
    assert_eq!(
        moves,
        vec![(a, Tier::Host, Tier::Disk), (c, Tier::Device, Tier::Host)]
    );
    // Still found, and restored from the host while its file is written.
    let found = store.lookup_longest(&chain(&[1])).unwrap();
    assert_eq!((found.snapshot, found.tier), (a, Tier::Host));
    store.commit_demotion(a).unwrap();
    store.commit_demotion(c).unwrap();
    let found = store.lookup_longest(&chain(&[1])).unwrap();
    assert_eq!((found.snapshot, found.tier), (a, Tier::Disk));
    assert!(matches!(
        store.begin_restore(a, 1, &[PageId(0)]),
        Err(CacheError::OnDisk { .. })
    ));
    let _ = (d, e);
    assert_eq!(store.stats().disk.charged_bytes, 10);
}

#[test]
fn a_promotion_reads_a_disk_snapshot_back_and_frees_its_file() {
    let mut store = disk_store(20, 100);
    let (a, backing) = store.adopt_disk(&chain(&[1, 2]), false).unwrap();
    assert_eq!(store.stats().disk.charged_bytes, 20);
    let hit = store.lookup_longest(&chain(&[1, 2, 3])).unwrap();
    assert_eq!((hit.snapshot, hit.tier, hit.pages), (a, Tier::Disk, 2));
    let PromotionStart::Started {
        promotion,
        evictions,
    } = store.begin_promotion(a).unwrap()
    else {
        panic!("not in flight yet")
    };
    assert!(evictions.is_empty());
    assert_eq!(
        (promotion.from, promotion.tier, promotion.bytes),
        (backing, Tier::Host, 20)
    );
    assert_eq!(store.begin_promotion(a).unwrap(), PromotionStart::InFlight);
    // Found while promoting (so requests wait), not restorable.
    assert_eq!(
        store.lookup_longest(&chain(&[1, 2])).unwrap().tier,
        Tier::Disk
    );
    let freed = store.commit_promotion(a).unwrap();
    assert_eq!(freed[0].backing, backing, "its file is deleted");
    let stats = store.stats();
    assert_eq!(
        (stats.disk.charged_bytes, stats.host.charged_bytes),
        (0, 20)
    );
    let plan = store.begin_restore(a, 2, &[PageId(4), PageId(5)]).unwrap();
    assert_eq!((plan.backing, plan.tier), (promotion.to, Tier::Host));
}

#[test]
fn a_failed_promotion_forgets_the_snapshot_and_its_file() {
    let mut store = disk_store(20, 100);
    let (a, backing) = store.adopt_disk(&chain(&[1]), true).unwrap();
    let PromotionStart::Started { .. } = store.begin_promotion(a).unwrap() else {
        panic!("started")
    };
    let freed = store.abort_promotion(a, true).unwrap();
    assert_eq!(freed[0].backing, backing);
    assert_eq!(state(&store, a), None);
    let stats = store.stats();
    assert_eq!((stats.disk.charged_bytes, stats.host.charged_bytes), (0, 0));
}

#[test]
fn a_promotion_that_could_not_run_leaves_the_snapshot_on_disk() {
    let mut store = disk_store(20, 100);
    let (a, backing) = store.adopt_disk(&chain(&[1]), false).unwrap();
    let PromotionStart::Started { .. } = store.begin_promotion(a).unwrap() else {
        panic!("started")
    };
    assert_eq!(store.abort_promotion(a, false).unwrap(), vec![]);
    let info = store.info(a).unwrap();
    assert_eq!(
        (info.tier, info.backing, info.state),
        (Tier::Disk, backing, SnapshotState::Ready)
    );
    let stats = store.stats();
    assert_eq!(
        (stats.disk.charged_bytes, stats.host.charged_bytes),
        (10, 0)
    );
    assert_eq!((stats.disk.snapshots, stats.host.snapshots), (1, 0));
    assert_eq!(store.eviction_order(Tier::Disk), vec![a]);
}

#[test]
fn a_flush_plans_memory_snapshots_newest_first_within_the_disk_budget() {
    let mut store = disk_store(0, 20);
    let [a, b, c] = [1, 2, 3].map(|page| save(&mut store, &[page]).0);
    hit(&mut store, &[1]);
    let plan = store.plan_flush();
    let order: Vec<_> = plan.copies.iter().map(|c| c.snapshot).collect();
    assert_eq!(order, vec![a, c], "a was used last, then c; b does not fit");
    let _ = b;
}

#[test]
fn find_pins_a_memory_hit_for_pages_named_later_and_starts_a_disk_hits_read_back() {
    let mut store = disk_store(20, 100);
    let (a, _) = save(&mut store, &[1, 2]);
    // In memory: pinned before the pages it goes to are known.
    let found = store.find(&chain(&[1, 2, 3]), true);
    let hit = found.hit.unwrap();
    assert_eq!((hit.snapshot, hit.pages, hit.tier), (a, 2, Tier::Device));
    let pinned = found.restore.unwrap().unwrap();
    assert!(found.promotion.is_none());
    assert_eq!(store.discard(a), Err(CacheError::Pinned { snapshot: a }));
    let plan = pinned.plan(&[PageId(7), PageId(3), PageId(9)]).unwrap();
    assert_eq!(plan.tokens, 2 * PAGE_TOKENS);
    assert_eq!(
        plan.copies.iter().map(|c| c.pool_page).collect::<Vec<_>>(),
        [PageId(7), PageId(3)]
    );
    assert!(matches!(
        pinned.plan(&[PageId(7)]),
        Err(CacheError::ShortPageTable { .. })
    ));
    store.finish_restore(a).unwrap();
    assert!(store.discard(a).is_ok());

    // On disk: read back when asked, found in flight by the next; not pinned.
    let (b, _) = store.adopt_disk(&chain(&[4]), false).unwrap();
    let found = store.find(&chain(&[4]), false);
    assert_eq!(found.hit.map(|h| h.tier), Some(Tier::Disk));
    assert!(found.restore.is_none() && found.promotion.is_none());
    let found = store.find(&chain(&[4]), true);
    assert!(matches!(
        found.promotion,
        Some(Ok(PromotionStart::Started { .. }))
    ));
    let found = store.find(&chain(&[4]), true);
    assert_eq!(found.promotion, Some(Ok(PromotionStart::InFlight)));
    assert_eq!(store.find(&chain(&[5]), true), Found::default());
    let _ = b;
}
