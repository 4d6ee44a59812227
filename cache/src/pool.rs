//! The working pool's bookkeeping: pages, the free list, slots with generations and page tables,
//! and reservations.
//!
//! Owns which page belongs to which sequence; never the bytes at a page (the engine holds them)
//! and never a snapshot (a snapshot owns its own buffer and is never a view of pool pages, seed
//! 002). Every call that names a sequence takes a [`SlotHandle`]; one whose generation no longer
//! matches is refused with `StaleSlot`, so a finished sequence's pages are never handed out or
//! read in its name.
//!
//! Costs: allocating or freeing a page is O(1), a pop or push on the free list; `admit` is O(1);
//! `extend`, `truncate` and `release` are O(pages they move). Running out is a value
//! (`ContextFull`), never a panic.
//!
//! Reservations: a slot admitted with a reservation of R pages is promised that growing to R
//! pages never fails. The pool keeps the invariant `outstanding <= free`, where `outstanding`
//! sums, over open slots, the reserved pages a slot does not hold yet; only `free - outstanding`
//! is available to anyone else. Truncating a slot below its reservation returns the pages to
//! the free list but keeps them promised to it.

use policy::ReservationPolicy;

use crate::error::CacheError;
use crate::geometry::PageId;
use crate::ids::{Generation, SlotHandle, SlotId};

/// The pool's shape and policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    pub total_pages: u32,
    pub page_tokens: usize,
    /// Sequences that may hold a slot at once (`admission.max_running`).
    pub max_slots: u32,
    pub reservation: ReservationPolicy,
}

/// A snapshot of the pool's counters, in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub total_pages: usize,
    pub free_pages: usize,
    pub used_pages: usize,
    /// Free pages promised to open slots.
    pub reserved_pages: usize,
    /// Free pages nobody is promised: what a new reservation or an optimistic extension can get.
    pub available_pages: usize,
    pub open_slots: usize,
    pub max_slots: usize,
}

#[derive(Debug, Clone, Default)]
struct Slot {
    generation: Generation,
    open: bool,
    pages: Vec<PageId>,
    tokens: usize,
    limit_tokens: usize,
    reserved_pages: usize,
}

impl Slot {
    /// Reserved pages this slot does not hold yet.
    fn outstanding(&self) -> usize {
        self.reserved_pages.saturating_sub(self.pages.len())
    }
}

/// The working pool: a fixed number of pages shared by a fixed number of slots.
#[derive(Debug, Clone)]
pub struct PagePool {
    config: PoolConfig,
    /// A stack: the most recently freed page is handed out first.
    free: Vec<PageId>,
    owner: Vec<Option<SlotId>>,
    slots: Vec<Slot>,
    free_slots: Vec<SlotId>,
    outstanding: usize,
}

impl PagePool {
    pub fn new(config: PoolConfig) -> PagePool {
        assert!(config.page_tokens > 0, "a page holds at least one token");
        PagePool {
            config,
            free: (0..config.total_pages).rev().map(PageId).collect(),
            owner: vec![None; config.total_pages as usize],
            slots: vec![Slot::default(); config.max_slots as usize],
            free_slots: (0..config.max_slots).rev().map(SlotId).collect(),
            outstanding: 0,
        }
    }

    pub fn config(&self) -> PoolConfig {
        self.config
    }

    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.page_tokens)
    }

    fn available(&self) -> usize {
        self.free.len() - self.outstanding
    }

    /// Opens a slot for a sequence of `prompt_tokens` that may generate `max_new_tokens`,
    /// reserving what the reservation policy asks. Nothing is allocated yet.
    pub fn admit(
        &mut self,
        prompt_tokens: usize,
        max_new_tokens: usize,
    ) -> Result<SlotHandle, CacheError> {
        let limit_tokens = prompt_tokens + max_new_tokens;
        let (needed_pages, total_pages) = (
            self.pages_for(limit_tokens),
            self.config.total_pages as usize,
        );
        if needed_pages > total_pages {
            return Err(CacheError::LargerThanPool {
                needed_pages,
                total_pages,
            });
        }
        let reserve = self
            .config
            .reservation
            .tokens_at_admission(prompt_tokens, max_new_tokens);
        let reserved_pages = self.pages_for(reserve);
        let slot = *self.free_slots.last().ok_or(CacheError::NoFreeSlot {
            max_slots: self.config.max_slots as usize,
        })?;
        if reserved_pages > self.available() {
            let free_pages = self.available();
            return Err(CacheError::ContextFull {
                needed_pages: reserved_pages,
                free_pages,
            });
        }
        self.free_slots.pop();
        self.outstanding += reserved_pages;
        let state = &mut self.slots[slot.index()];
        state.generation = state.generation.next();
        state.open = true;
        state.tokens = 0;
        state.limit_tokens = limit_tokens;
        state.reserved_pages = reserved_pages;
        Ok(SlotHandle {
            slot,
            generation: state.generation,
        })
    }

    /// The slot index behind `handle`, if the handle is still current.
    fn check(&self, handle: SlotHandle) -> Result<usize, CacheError> {
        match self.slots.get(handle.slot.index()) {
            Some(slot) if slot.open && slot.generation == handle.generation => {
                Ok(handle.slot.index())
            }
            _ => Err(CacheError::StaleSlot { handle }),
        }
    }

    /// Grows the sequence by `tokens` positions, taking pages from its own reservation first and
    /// from the available pages after. All or nothing: on `ContextFull` nothing changed.
    /// Returns the whole page table.
    pub fn extend(&mut self, handle: SlotHandle, tokens: usize) -> Result<&[PageId], CacheError> {
        let index = self.check(handle)?;
        let slot = &self.slots[index];
        let requested_tokens = slot.tokens + tokens;
        if requested_tokens > slot.limit_tokens {
            let limit_tokens = slot.limit_tokens;
            return Err(CacheError::SlotLimit {
                limit_tokens,
                requested_tokens,
            });
        }
        let need = self.pages_for(requested_tokens) - slot.pages.len();
        let from_reservation = need.min(slot.outstanding());
        let beyond = need - from_reservation;
        if beyond > self.available() {
            let free_pages = self.available();
            return Err(CacheError::ContextFull {
                needed_pages: beyond,
                free_pages,
            });
        }
        self.outstanding -= from_reservation;
        let slot = &mut self.slots[index];
        for _ in 0..need {
            let page = self
                .free
                .pop()
                .expect("need <= outstanding + available <= free");
            debug_assert!(
                self.owner[page.index()].is_none(),
                "a free page has no owner"
            );
            self.owner[page.index()] = Some(handle.slot);
            slot.pages.push(page);
        }
        slot.tokens = requested_tokens;
        Ok(&slot.pages)
    }

    /// Cuts the sequence back to its first `tokens` positions (rejected speculative tokens) and
    /// frees the pages past them. Returns the number of pages freed.
    pub fn truncate(&mut self, handle: SlotHandle, tokens: usize) -> Result<usize, CacheError> {
        let index = self.check(handle)?;
        let keep = self.pages_for(tokens);
        let slot = &mut self.slots[index];
        if tokens > slot.tokens {
            let held_tokens = slot.tokens;
            return Err(CacheError::TruncateBeyondEnd {
                held_tokens,
                requested_tokens: tokens,
            });
        }
        let before = slot.outstanding();
        let freed = slot.pages.len() - keep;
        for page in slot.pages.drain(keep..).rev() {
            self.owner[page.index()] = None;
            self.free.push(page);
        }
        slot.tokens = tokens;
        self.outstanding += slot.outstanding() - before;
        Ok(freed)
    }

    /// Ends the sequence: its pages return to the free list, its reservation is dropped, and its
    /// handle is stale from now on. Returns the number of pages freed.
    pub fn release(&mut self, handle: SlotHandle) -> Result<usize, CacheError> {
        let index = self.check(handle)?;
        let slot = &mut self.slots[index];
        self.outstanding -= slot.outstanding();
        let freed = slot.pages.len();
        // Pushed in reverse so the next sequence is handed these pages in their old order.
        for page in slot.pages.drain(..).rev() {
            self.owner[page.index()] = None;
            self.free.push(page);
        }
        slot.open = false;
        slot.tokens = 0;
        slot.reserved_pages = 0;
        self.free_slots.push(handle.slot);
        Ok(freed)
    }

    /// The sequence's page table: page `i` holds positions `i * page_tokens ..`.
    pub fn page_table(&self, handle: SlotHandle) -> Result<&[PageId], CacheError> {
        Ok(&self.slots[self.check(handle)?].pages)
    }

    /// Positions the sequence holds.
    pub fn tokens(&self, handle: SlotHandle) -> Result<usize, CacheError> {
        Ok(self.slots[self.check(handle)?].tokens)
    }

    /// The current handle of the slot holding `page`, or `None` if the page is free.
    pub fn page_owner(&self, page: PageId) -> Option<SlotHandle> {
        let slot = (*self.owner.get(page.index())?)?;
        let generation = self.slots[slot.index()].generation;
        Some(SlotHandle { slot, generation })
    }

    /// Every open slot with its page table.
    pub fn open_slots(&self) -> impl Iterator<Item = (SlotHandle, &[PageId])> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.open)
            .map(|(index, slot)| {
                let handle = SlotHandle {
                    slot: SlotId(index as u32),
                    generation: slot.generation,
                };
                (handle, slot.pages.as_slice())
            })
    }

    pub fn stats(&self) -> PoolStats {
        let total_pages = self.config.total_pages as usize;
        PoolStats {
            total_pages,
            free_pages: self.free.len(),
            used_pages: total_pages - self.free.len(),
            reserved_pages: self.outstanding,
            available_pages: self.available(),
            open_slots: self.slots.len() - self.free_slots.len(),
            max_slots: self.slots.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 8 pages of 4 tokens, 3 slots.
    fn pool(reservation: ReservationPolicy) -> PagePool {
        PagePool::new(PoolConfig {
            total_pages: 8,
            page_tokens: 4,
            max_slots: 3,
            reservation,
        })
    }

    fn ids(pages: &[PageId]) -> Vec<u32> {
        pages.iter().map(|page| page.0).collect()
    }

    #[test]
    fn growth_takes_pages_from_the_free_list_in_order() {
        let mut pool = pool(ReservationPolicy::Optimistic);
        let a = pool.admit(5, 7).unwrap();
        assert_eq!(
            a,
            SlotHandle {
                slot: SlotId(0),
                generation: Generation(1)
            }
        );
        assert_eq!(ids(pool.extend(a, 5).unwrap()), vec![0, 1]);
        assert_eq!(
            ids(pool.extend(a, 3).unwrap()),
            vec![0, 1],
            "8 tokens still fit two pages"
        );
        assert_eq!(ids(pool.extend(a, 1).unwrap()), vec![0, 1, 2]);
        assert_eq!(pool.tokens(a), Ok(9));
        assert_eq!(pool.page_owner(PageId(2)), Some(a));
        assert_eq!(pool.page_owner(PageId(3)), None);
        let stats = pool.stats();
        assert_eq!(
            (stats.used_pages, stats.free_pages, stats.open_slots),
            (3, 5, 1)
        );
    }

    #[test]
    fn worst_case_reserves_at_admission_and_never_runs_dry() {
        let mut pool = pool(ReservationPolicy::WorstCase);
        let a = pool.admit(8, 8).unwrap();
        assert_eq!(
            (pool.stats().reserved_pages, pool.stats().available_pages),
            (4, 4)
        );
        assert_eq!(
            pool.admit(8, 12),
            Err(CacheError::ContextFull {
                needed_pages: 5,
                free_pages: 4
            })
        );
        let b = pool.admit(8, 8).unwrap();
        assert_eq!(pool.stats().available_pages, 0);
        assert_eq!(ids(pool.extend(b, 16).unwrap()), vec![0, 1, 2, 3]);
        assert_eq!(ids(pool.extend(a, 16).unwrap()), vec![4, 5, 6, 7]);
        let stats = pool.stats();
        assert_eq!((stats.free_pages, stats.reserved_pages), (0, 0));
    }

    #[test]
    fn optimistic_growth_reports_context_full_as_a_value_and_changes_nothing() {
        let mut pool = pool(ReservationPolicy::Optimistic);
        let a = pool.admit(0, 32).unwrap();
        let b = pool.admit(0, 32).unwrap();
        pool.extend(a, 24).unwrap();
        assert_eq!(
            pool.extend(b, 12),
            Err(CacheError::ContextFull {
                needed_pages: 3,
                free_pages: 2
            })
        );
        assert_eq!(pool.page_table(b), Ok(&[][..]));
        assert_eq!(pool.tokens(b), Ok(0));
        assert_eq!(pool.stats().free_pages, 2);
    }

    #[test]
    fn a_worst_case_slot_keeps_its_truncated_tail_promised() {
        let mut pool = pool(ReservationPolicy::WorstCase);
        let a = pool.admit(4, 12).unwrap();
        pool.extend(a, 16).unwrap();
        assert_eq!(pool.truncate(a, 5), Ok(2));
        assert_eq!(ids(pool.page_table(a).unwrap()), vec![0, 1]);
        let stats = pool.stats();
        assert_eq!(
            (
                stats.free_pages,
                stats.reserved_pages,
                stats.available_pages
            ),
            (6, 2, 4)
        );
        assert_eq!(
            pool.admit(20, 0),
            Err(CacheError::ContextFull {
                needed_pages: 5,
                free_pages: 4
            })
        );
        assert_eq!(
            ids(pool.extend(a, 11).unwrap()),
            vec![0, 1, 2, 3],
            "the tail comes back in order"
        );
    }

    #[test]
    fn truncating_rolls_back_rejected_tokens() {
        let mut pool = pool(ReservationPolicy::Optimistic);
        let a = pool.admit(4, 16).unwrap();
        pool.extend(a, 4).unwrap();
        pool.extend(a, 8).unwrap();
        assert_eq!(
            pool.truncate(a, 6),
            Ok(1),
            "12 tokens on 3 pages back to 6 on 2"
        );
        assert_eq!((pool.tokens(a), pool.stats().free_pages), (Ok(6), 6));
        assert_eq!(pool.truncate(a, 6), Ok(0));
        assert_eq!(
            pool.truncate(a, 7),
            Err(CacheError::TruncateBeyondEnd {
                held_tokens: 6,
                requested_tokens: 7
            })
        );
    }

    #[test]
    fn a_stale_slot_handle_is_refused_and_never_reaches_the_new_owners_pages() {
        let mut pool = pool(ReservationPolicy::Optimistic);
        let old = pool.admit(4, 4).unwrap();
        pool.extend(old, 4).unwrap();
        assert_eq!(pool.release(old), Ok(1));
        let stale = Err(CacheError::StaleSlot { handle: old });
        assert_eq!(pool.page_table(old), stale.map(|()| &[][..]));
        let new = pool.admit(4, 4).unwrap();
        assert_eq!((new.slot, new.generation), (old.slot, Generation(2)));
        pool.extend(new, 4).unwrap();
        assert_eq!(
            pool.extend(old, 1),
            Err(CacheError::StaleSlot { handle: old })
        );
        assert_eq!(
            pool.truncate(old, 0),
            Err(CacheError::StaleSlot { handle: old })
        );
        assert_eq!(
            pool.release(old),
            Err(CacheError::StaleSlot { handle: old })
        );
        assert_eq!(pool.tokens(new), Ok(4), "the new owner is untouched");
        let forged = SlotHandle {
            slot: SlotId(99),
            generation: Generation(1),
        };
        assert_eq!(
            pool.tokens(forged),
            Err(CacheError::StaleSlot { handle: forged })
        );
    }

    #[test]
    fn a_release_hands_the_pages_to_the_next_sequence_in_their_old_order() {
        let mut pool = pool(ReservationPolicy::Optimistic);
        let a = pool.admit(12, 0).unwrap();
        pool.extend(a, 12).unwrap();
        let b = pool.admit(4, 0).unwrap();
        pool.extend(b, 4).unwrap();
        pool.release(a).unwrap();
        let c = pool.admit(16, 0).unwrap();
        assert_eq!(ids(pool.extend(c, 16).unwrap()), vec![0, 1, 2, 4]);
    }

    #[test]
    fn limits_are_refused_with_their_own_errors() {
        let mut pool = pool(ReservationPolicy::Optimistic);
        assert_eq!(
            pool.admit(30, 3),
            Err(CacheError::LargerThanPool {
                needed_pages: 9,
                total_pages: 8
            })
        );
        let a = pool.admit(2, 2).unwrap();
        assert_eq!(
            pool.extend(a, 5),
            Err(CacheError::SlotLimit {
                limit_tokens: 4,
                requested_tokens: 5
            })
        );
        pool.admit(1, 0).unwrap();
        pool.admit(1, 0).unwrap();
        assert_eq!(
            pool.admit(1, 0),
            Err(CacheError::NoFreeSlot { max_slots: 3 })
        );
        assert_eq!(pool.stats().open_slots, 3);
    }
}
