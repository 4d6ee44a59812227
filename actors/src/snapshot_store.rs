//! The `SnapshotStore` actor: owns the snapshot index ([`cache::SnapshotStore`]): budgets,
//! charges, recency, pins, prefix lookup and tiers.
//!
//! It decides what is kept and where; the engine holds the bytes of each backing. The scheduler
//! sends it one [`StoreStep`] a step, so the store costs a round trip, not one per request.

use actix::{Actor, Context, Handler, Message, MessageResult};
use cache::{
    BackingId, CacheError, FlushPlan, SnapshotId, SnapshotInfo, SnapshotStore as Store, StoreStats,
};

pub use crate::exchange::{StoreOp, StoreReply};

pub struct SnapshotStore {
    store: Store,
}

impl SnapshotStore {
    pub fn new(store: Store) -> Self {
        SnapshotStore { store }
    }

    /// The index itself, for tests that check it against the engine.
    #[cfg(test)]
    pub(crate) fn inner(&self) -> &Store {
        &self.store
    }

    #[cfg(test)]
    pub(crate) fn inner_mut(&mut self) -> &mut Store {
        &mut self.store
    }
}

impl Actor for SnapshotStore {
    type Context = Context<Self>;
}

#[derive(Debug, Message)]
#[rtype(result = "StoreStepReply")]
pub struct StoreStep(pub Vec<StoreOp>);

#[derive(Debug)]
pub struct StoreStepReply {
    pub replies: Vec<StoreReply>,
    pub stats: StoreStats,
}

impl SnapshotStore {
    /// Applies one request (the handler applies a step's in order).
    pub fn apply(&mut self, op: StoreOp) -> StoreReply {
        match op {
            StoreOp::Find { chain, promote } => StoreReply::Found(self.store.find(&chain, promote)),
            StoreOp::FinishRestore(snapshot) => {
                StoreReply::Done(self.store.finish_restore(snapshot))
            }
            StoreOp::BeginSave { chain, tier } => {
                StoreReply::Save(self.store.begin_save(&chain, tier))
            }
            StoreOp::BeginKeptSave { chain, tier } => {
                StoreReply::Save(self.store.begin_kept_save(&chain, tier))
            }
            StoreOp::BeginPromptSave { chain, tier } => {
                StoreReply::Save(self.store.begin_prompt_save(&chain, tier))
            }
            StoreOp::CommitSave(reservation) => {
                StoreReply::Done(self.store.commit_save(reservation).map(drop))
            }
            StoreOp::AbortSave(reservation) => StoreReply::Done(self.store.abort_save(reservation)),
            StoreOp::CommitDemotion(snapshot) => {
                StoreReply::Freed(self.store.commit_demotion(snapshot))
            }
            StoreOp::DropCorrupt(snapshot) => StoreReply::Freed(self.store.drop_corrupt(snapshot)),
            StoreOp::CommitPromotion(snapshot) => {
                StoreReply::Freed(self.store.commit_promotion(snapshot))
            }
            StoreOp::AbortPromotion { snapshot, corrupt } => {
                StoreReply::Freed(self.store.abort_promotion(snapshot, corrupt))
            }
            StoreOp::AbortDemotion(snapshot) => {
                StoreReply::Done(self.store.abort_demotion(snapshot))
            }
        }
    }
}

impl Handler<StoreStep> for SnapshotStore {
    type Result = MessageResult<StoreStep>;

    fn handle(&mut self, step: StoreStep, _: &mut Context<Self>) -> Self::Result {
        let replies = step.0.into_iter().map(|op| self.apply(op)).collect();
        MessageResult(StoreStepReply {
            replies,
            stats: self.store.stats(),
        })
    }
}

/// Every snapshot the store holds, in no particular order.
#[derive(Debug, Message)]
#[rtype(result = "Vec<SnapshotInfo>")]
pub struct ListSnapshots;

impl Handler<ListSnapshots> for SnapshotStore {
    type Result = MessageResult<ListSnapshots>;

    fn handle(&mut self, _: ListSnapshots, _: &mut Context<Self>) -> Self::Result {
        let store = &self.store;
        MessageResult(
            store
                .snapshot_ids()
                .filter_map(|id| store.info(id).ok())
                .collect(),
        )
    }
}

/// What the store knows of one snapshot.
#[derive(Debug, Message)]
#[rtype(result = "Result<SnapshotInfo, CacheError>")]
pub struct GetSnapshot(pub SnapshotId);

impl Handler<GetSnapshot> for SnapshotStore {
    type Result = Result<SnapshotInfo, CacheError>;

    fn handle(&mut self, msg: GetSnapshot, _: &mut Context<Self>) -> Self::Result {
        self.store.info(msg.0)
    }
}

/// Drops a published snapshot no restore is reading, kept or not; answers the backing the
/// engine must free.
#[derive(Debug, Message)]
#[rtype(result = "Result<BackingId, CacheError>")]
pub struct DiscardSnapshot(pub SnapshotId);

impl Handler<DiscardSnapshot> for SnapshotStore {
    type Result = Result<BackingId, CacheError>;

    fn handle(&mut self, msg: DiscardSnapshot, _: &mut Context<Self>) -> Self::Result {
        self.store.discard(msg.0)
    }
}

/// What a clean shutdown writes to the disk tier ([`cache::SnapshotStore::plan_flush`]).
#[derive(Debug, Message)]
#[rtype(result = "FlushPlan")]
pub struct PlanFlush;

impl Handler<PlanFlush> for SnapshotStore {
    type Result = MessageResult<PlanFlush>;

    fn handle(&mut self, _: PlanFlush, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.store.plan_flush())
    }
}

/// The store's counters.
#[derive(Debug, Message)]
#[rtype(result = "StoreStats")]
pub struct GetStoreStats;

impl Handler<GetStoreStats> for SnapshotStore {
    type Result = MessageResult<GetStoreStats>;

    fn handle(&mut self, _: GetStoreStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.store.stats())
    }
}
