//! The `KvPool` actor: owns the working pool's bookkeeping ([`cache::PagePool`]).
//!
//! It decides which page each sequence's positions go to and nothing else; the bytes at a page
//! belong to the engine. The scheduler sends one [`PoolStep`] per step, so the pool is a single
//! round trip whatever the batch size.

use actix::{Actor, Context, Handler, Message, MessageResult};
use cache::{CacheError, PageId, PagePool, PoolStats, SlotHandle};

pub use crate::exchange::{PoolOp, PoolReply};

pub struct KvPool {
    pool: PagePool,
}

impl KvPool {
    pub fn new(pool: PagePool) -> Self {
        KvPool { pool }
    }

    /// The bookkeeping itself, for tests that check it against the scheduler.
    #[cfg(test)]
    pub(crate) fn inner(&self) -> &PagePool {
        &self.pool
    }
}

impl Actor for KvPool {
    type Context = Context<Self>;
}

/// A step's pool changes, applied in order.
#[derive(Debug, Message)]
#[rtype(result = "PoolStepReply")]
pub struct PoolStep(pub Vec<PoolOp>);

#[derive(Debug)]
pub struct PoolStepReply {
    pub replies: Vec<PoolReply>,
    pub stats: PoolStats,
}

impl KvPool {
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Positions the pool has allocated to a slot.
    pub fn slot_tokens(&self, handle: cache::SlotHandle) -> Result<usize, cache::CacheError> {
        self.pool.tokens(handle)
    }

    /// Applies one change (the handler applies a step's in order).
    pub fn apply(&mut self, op: PoolOp) -> PoolReply {
        match op {
            PoolOp::Release(handle) => PoolReply::Released(self.pool.release(handle)),
            PoolOp::Truncate { handle, tokens } => {
                PoolReply::Truncated(self.pool.truncate(handle, tokens))
            }
            PoolOp::Admit {
                prompt_tokens,
                max_new_tokens,
                initial_tokens,
            } => PoolReply::Admitted(self.admit(prompt_tokens, max_new_tokens, initial_tokens)),
            PoolOp::Extend { handle, tokens } => {
                let before = self.pool.page_table(handle).map(<[PageId]>::len);
                PoolReply::Extended(
                    before.and_then(|before| {
                        Ok(self.pool.extend(handle, tokens)?[before..].to_vec())
                    }),
                )
            }
        }
    }

    /// All or nothing: a slot whose first positions cannot be allocated is closed again.
    fn admit(
        &mut self,
        prompt_tokens: usize,
        max_new_tokens: usize,
        initial_tokens: usize,
    ) -> Result<(SlotHandle, Vec<PageId>), CacheError> {
        let handle = self.pool.admit(prompt_tokens, max_new_tokens)?;
        match self.pool.extend(handle, initial_tokens) {
            Ok(pages) => Ok((handle, pages.to_vec())),
            Err(e) => {
                self.pool
                    .release(handle)
                    .expect("the handle was just issued");
                Err(e)
            }
        }
    }
}

impl Handler<PoolStep> for KvPool {
    type Result = MessageResult<PoolStep>;

    fn handle(&mut self, step: PoolStep, _: &mut Context<Self>) -> Self::Result {
        let replies = step.0.into_iter().map(|op| self.apply(op)).collect();
        MessageResult(PoolStepReply {
            replies,
            stats: self.pool.stats(),
        })
    }
}

/// The pool's counters.
#[derive(Debug, Message)]
#[rtype(result = "PoolStats")]
pub struct GetPoolStats;

impl Handler<GetPoolStats> for KvPool {
    type Result = MessageResult<GetPoolStats>;

    fn handle(&mut self, _: GetPoolStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.pool.stats())
    }
}
