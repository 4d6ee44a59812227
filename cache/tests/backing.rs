//! A snapshot owns its bytes (seed 002): it stays restorable, byte for byte, after every pool
//! page it was saved from has been reused by other slots and overwritten.
//!
//! A toy engine stands in for the backend: pool pages and snapshot buffers are plain byte
//! vectors, and copies follow the plans and frames the cache hands out.

use std::collections::HashMap;

use cache::{
    BackingId, Frame, KvGeometry, PageCopy, PagePool, PoolConfig, PrefixHasher, PrefixSalt,
    SaveStart, SlotHandle, SnapshotGeometry, SnapshotStore, Tier, payload_crc32,
};
use policy::{ReservationPolicy, SnapshotConfig};

const PAGE_TOKENS: usize = 4;

fn geometry() -> SnapshotGeometry {
    let kv = KvGeometry {
        layers: 2,
        kv_heads: 1,
        head_dim: 2,
        page_tokens: PAGE_TOKENS,
        dtype_bytes: 2,
    };
    SnapshotGeometry {
        kv,
        fixed_state_bytes: 0,
    }
}

struct ToyEngine {
    page_bytes: usize,
    pages: Vec<Vec<u8>>,
    buffers: HashMap<BackingId, Vec<u8>>,
}

impl ToyEngine {
    fn new(total_pages: usize) -> ToyEngine {
        let page_bytes = geometry().kv.page_bytes();
        ToyEngine {
            page_bytes,
            pages: vec![vec![0; page_bytes]; total_pages],
            buffers: HashMap::new(),
        }
    }

    /// A prefill writing `fill` into every page of `table`.
    fn write(&mut self, table: &[cache::PageId], fill: impl Fn(usize, usize) -> u8) {
        for (row, page) in table.iter().enumerate() {
            let bytes = &mut self.pages[page.index()];
            bytes
                .iter_mut()
                .enumerate()
                .for_each(|(at, byte)| *byte = fill(row, at));
        }
    }

    fn save(&mut self, backing: BackingId, bytes: u64, copies: &[PageCopy]) -> &[u8] {
        let mut buffer = vec![0; bytes as usize];
        for copy in copies {
            let row = copy.snapshot_page as usize * self.page_bytes;
            buffer[row..row + self.page_bytes].copy_from_slice(&self.pages[copy.pool_page.index()]);
        }
        self.buffers.entry(backing).insert_entry(buffer).into_mut()
    }

    fn restore(&mut self, backing: BackingId, copies: &[PageCopy]) {
        let buffer = &self.buffers[&backing];
        for copy in copies {
            let row = copy.snapshot_page as usize * self.page_bytes;
            self.pages[copy.pool_page.index()].copy_from_slice(&buffer[row..row + self.page_bytes]);
        }
    }
}

fn prompt_pattern(row: usize, at: usize) -> u8 {
    (row * 31 + at) as u8
}

/// Saves a 2-page prompt from one slot, lets two other slots take and overwrite every page,
/// frees the slot at `freed` (0 or 1), and restores into a new slot. Returns the restored
/// pages' bytes, the snapshot buffer, and whether the restore went into the very pages the
/// snapshot was saved from.
fn save_reuse_restore(freed: usize) -> (Vec<Vec<u8>>, Vec<u8>, bool) {
    let mut pool = PagePool::new(PoolConfig {
        total_pages: 4,
        page_tokens: PAGE_TOKENS,
        max_slots: 3,
        reservation: ReservationPolicy::Optimistic,
    });
    let config = SnapshotConfig {
        device_budget_bytes: 1 << 20,
        ..Default::default()
    };
    let mut store = SnapshotStore::new(geometry(), &config.validate().unwrap());
    let mut engine = ToyEngine::new(4);
    let prompt: Vec<u32> = (100..108).collect();
    let chain = PrefixHasher::new(PrefixSalt::new("toy", None), PAGE_TOKENS).chain(&prompt);

    let writer = pool.admit(prompt.len(), 0).unwrap();
    let saved_from = pool.extend(writer, prompt.len()).unwrap().to_vec();
    engine.write(&saved_from, prompt_pattern);
    let SaveStart::Reserved { reservation, .. } = store.begin_save(&chain, Tier::Device).unwrap()
    else {
        panic!("nothing is stored yet");
    };
    let copies = reservation.copies(&saved_from).unwrap();
    let saved = engine
        .save(reservation.backing(), reservation.bytes(), &copies)
        .to_vec();
    let frame_bytes = reservation
        .frame(writer, payload_crc32(&saved))
        .encode()
        .unwrap();
    store.commit_save(reservation).unwrap();
    pool.release(writer).unwrap();

    let others: Vec<SlotHandle> = (0..2).map(|_| pool.admit(8, 0).unwrap()).collect();
    for &other in &others {
        let table = pool.extend(other, 8).unwrap().to_vec();
        engine.write(&table, |_, _| 0xa5);
    }
    for page in &saved_from {
        assert!(
            others.contains(
                &pool
                    .page_owner(*page)
                    .expect("every saved-from page is reused")
            )
        );
    }
    pool.release(others[freed]).unwrap();

    let hit = store
        .lookup_longest(&chain)
        .expect("the snapshot outlived its pages");
    let reader = pool.admit(prompt.len() + 4, 4).unwrap();
    let table = pool.extend(reader, hit.tokens).unwrap().to_vec();
    let plan = store
        .begin_restore(hit.snapshot, hit.pages, &table)
        .unwrap();
    let frame = Frame::decode(&frame_bytes).unwrap();
    frame.check_payload(&engine.buffers[&plan.backing]).unwrap();
    engine.restore(plan.backing, &plan.copies);
    store.finish_restore(hit.snapshot).unwrap();
    let restored = table
        .iter()
        .map(|page| engine.pages[page.index()].clone())
        .collect();
    (restored, saved, table == saved_from)
}

fn expected_prompt_bytes() -> Vec<Vec<u8>> {
    let page_bytes = geometry().kv.page_bytes();
    (0..2)
        .map(|row| (0..page_bytes).map(|at| prompt_pattern(row, at)).collect())
        .collect()
}

#[test]
fn a_snapshot_restores_into_its_old_pages_after_they_were_reused() {
    let (restored, saved, same_base) = save_reuse_restore(0);
    assert!(
        same_base,
        "the freed slot held exactly the pages the snapshot was saved from"
    );
    assert_eq!(restored, expected_prompt_bytes());
    assert_eq!(
        saved,
        expected_prompt_bytes().concat(),
        "the buffer holds the prompt, not the pool"
    );
}

#[test]
fn a_snapshot_restores_into_other_pages_after_its_own_were_reused() {
    let (restored, _, same_base) = save_reuse_restore(1);
    assert!(!same_base, "relocated");
    assert_eq!(restored, expected_prompt_bytes());
}
