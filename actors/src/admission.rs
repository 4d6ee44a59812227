//! The `Admission` actor: holds the scheduler ([`crate::scheduler::Scheduler`]) and drives its
//! steps through the `SnapshotStore`, `KvPool` and `Engine` actors.
//!
//! A step is one chain of four exchanges (store, pool, store, engine); while it is in flight,
//! submissions and cancellations are still handled, so the queue fills while the engine works;
//! each raises the engine's interrupt, which ends a multi-step decode after the decode step it
//! is in, so a newcomer is admitted one decode step later, not `decode_steps`.
//! When a step ends with work left, the next starts at once; when every job is backing off, a
//! timer wakes the loop; when there is nothing to do, the next submission does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, MessageResult,
    SpawnHandle, WrapFuture,
};

use crate::engine::{Engine, EngineStepReply};
use crate::error::ServeError;
use crate::kv_pool::{KvPool, PoolStep};
use crate::request::{GenerateRequest, RequestId, RequestStream};
use crate::scheduler::{Scheduler, SchedulerStats, StepOutcome};
use crate::snapshot_store::{SnapshotStore, StoreStep};

pub struct Admission {
    scheduler: Scheduler,
    pool: Addr<KvPool>,
    store: Addr<SnapshotStore>,
    engine: Addr<Engine>,
    /// The engine's interrupt ([`Engine::interrupt`]): raised by arrivals, cancellations and
    /// ended back-offs, lowered when a step is planned (which sees them).
    interrupt: Arc<AtomicBool>,
    stepping: bool,
    wake: Option<SpawnHandle>,
    mailbox_capacity: usize,
}

impl Admission {
    pub fn new(
        scheduler: Scheduler,
        pool: Addr<KvPool>,
        store: Addr<SnapshotStore>,
        engine: Addr<Engine>,
        interrupt: Arc<AtomicBool>,
        mailbox_capacity: usize,
    ) -> Self {
        Admission {
            scheduler,
            pool,
            store,
            engine,
            interrupt,
            stepping: false,
            wake: None,
            mailbox_capacity,
        }
    }

    /// Starts a step if one can run, else arms the timer for the next back-off to end. Called
    /// by every arrival and cancellation, and by that timer: during a step, each cuts a
    /// multi-step decode short, since the next step has new work to plan.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.stepping {
            self.interrupt.store(true, Ordering::Release);
            return;
        }
        let now = Instant::now();
        let (ready, wake_at) = self.scheduler.readiness(now);
        if ready {
            self.run_step(ctx);
        } else if let Some(at) = wake_at {
            self.arm(ctx, at);
        }
    }

    fn arm(&mut self, ctx: &mut Context<Self>, at: Instant) {
        if let Some(handle) = self.wake.take() {
            ctx.cancel_future(handle);
        }
        let delay = at.saturating_duration_since(Instant::now());
        self.wake = Some(ctx.run_later(delay, |act, ctx| {
            act.wake = None;
            act.kick(ctx);
        }));
    }

    fn after(&mut self, outcome: StepOutcome, ctx: &mut Context<Self>) {
        self.stepping = false;
        if outcome.ready {
            self.run_step(ctx);
        } else if let Some(at) = outcome.wake_at {
            self.arm(ctx, at);
        }
    }

    fn run_step(&mut self, ctx: &mut Context<Self>) {
        self.stepping = true;
        // This step's planning sees every arrival so far.
        self.interrupt.store(false, Ordering::Release);
        let started = Instant::now();
        let lookups = self.scheduler.begin_step(Instant::now());
        let store = self.store.clone();
        let step = async move {
            if lookups.is_empty() {
                return Vec::new();
            }
            store
                .send(StoreStep(lookups))
                .await
                .expect("the SnapshotStore actor runs as long as Admission")
                .replies
        }
        .into_actor(self)
        .then(|replies, act, _| {
            let ops = act.scheduler.plan_pool(replies);
            let pool = act.pool.clone();
            async move {
                if ops.is_empty() {
                    return (Vec::new(), None);
                }
                let reply = pool
                    .send(PoolStep(ops))
                    .await
                    .expect("the KvPool actor runs as long as Admission");
                (reply.replies, Some(reply.stats))
            }
            .into_actor(act)
        })
        .then(|(replies, stats), act, _| {
            let ops = act.scheduler.plan_store(replies, stats, Instant::now());
            let store = act.store.clone();
            async move {
                if ops.is_empty() {
                    return Vec::new();
                }
                store
                    .send(StoreStep(ops))
                    .await
                    .expect("the SnapshotStore actor runs as long as Admission")
                    .replies
            }
            .into_actor(act)
        })
        .then(|replies, act, _| {
            let step = act.scheduler.plan_engine(replies);
            let engine = act.engine.clone();
            async move {
                let step = step?;
                let shape = EngineStepReply::shape_of(&step);
                Some(engine.send(step).await.unwrap_or_else(|e| {
                    EngineStepReply::failed(shape, &format!("the engine is unavailable: {e}"))
                }))
            }
            .into_actor(act)
        })
        .map(move |reply: Option<EngineStepReply>, act, ctx| {
            crate::metrics::step_done(started.elapsed().as_secs_f64());
            if let Some(reply) = reply.as_ref().filter(|r| r.forward.is_ok()) {
                crate::metrics::forward_done(reply.first_step_seconds);
            }
            let outcome = act.scheduler.finish_step(reply, Instant::now());
            act.after(outcome, ctx);
        });
        ctx.spawn(step);
    }
}

impl Actor for Admission {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(self.mailbox_capacity);
    }
}

/// Queues a request; refused at once when invalid or when the queue is full.
#[derive(Debug, Message)]
#[rtype(result = "Result<RequestStream, ServeError>")]
pub struct Submit(pub GenerateRequest);

impl Handler<Submit> for Admission {
    type Result = Result<RequestStream, ServeError>;

    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) -> Self::Result {
        let stream = self.scheduler.submit(msg.0)?;
        self.kick(ctx);
        Ok(stream)
    }
}

/// Submits `n` choices of one request (OpenAI's `n`), which compute the prompt once; see
/// [`crate::scheduler::Scheduler::submit_choices`].
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<RequestStream>, ServeError>")]
pub struct SubmitChoices(pub GenerateRequest, pub usize);

impl Handler<SubmitChoices> for Admission {
    type Result = Result<Vec<RequestStream>, ServeError>;

    fn handle(&mut self, msg: SubmitChoices, ctx: &mut Context<Self>) -> Self::Result {
        let streams = self.scheduler.submit_choices(msg.0, msg.1)?;
        self.kick(ctx);
        Ok(streams)
    }
}

/// Submits a prompt to compute and keep; see [`crate::scheduler::Scheduler::submit_kept`].
#[derive(Debug, Message)]
#[rtype(result = "Result<RequestStream, ServeError>")]
pub struct SubmitKept(pub Vec<u32>);

impl Handler<SubmitKept> for Admission {
    type Result = Result<RequestStream, ServeError>;

    fn handle(&mut self, msg: SubmitKept, ctx: &mut Context<Self>) -> Self::Result {
        let stream = self.scheduler.submit_kept(msg.0)?;
        self.kick(ctx);
        Ok(stream)
    }
}

/// Cancels a request; its terminal event is `Cancelled`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Cancel(pub RequestId);

impl Handler<Cancel> for Admission {
    type Result = ();

    fn handle(&mut self, msg: Cancel, ctx: &mut Context<Self>) {
        self.scheduler.cancel(msg.0);
        self.kick(ctx);
    }
}

/// Stops taking requests (they are refused with `ShuttingDown`); those in flight go on.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Drain;

impl Handler<Drain> for Admission {
    type Result = ();

    fn handle(&mut self, _: Drain, _: &mut Context<Self>) {
        self.scheduler.drain();
    }
}

/// Ends every request in flight with `ShuttingDown`; answers how many there were.
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct CutAll;

impl Handler<CutAll> for Admission {
    type Result = usize;

    fn handle(&mut self, _: CutAll, ctx: &mut Context<Self>) -> usize {
        let cut = self.scheduler.cut_all();
        self.kick(ctx);
        cut
    }
}

/// The scheduler's counters.
#[derive(Debug, Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetSchedulerStats;

impl Handler<GetSchedulerStats> for Admission {
    type Result = MessageResult<GetSchedulerStats>;

    fn handle(&mut self, _: GetSchedulerStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.scheduler.stats())
    }
}
