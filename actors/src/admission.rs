//! The `Admission` actor: holds the scheduler ([`crate::scheduler::Scheduler`]) and drives its
//! steps through the `SnapshotStore`, `KvPool` and `Engine` actors.
//!
//! Planning a step is one chain of exchanges, one with each actor: the store (lookups and
//! saves), the pool (pages), then the engine step sent. The next step is planned as soon as that one is sent, while the engine
//! runs it ([`Scheduler::can_plan_ahead`]): its rows start from the tokens the step ahead of
//! them picks, which the engine fills in, so the exchanges, the planning and the delivery of
//! tokens overlap the forward pass. At most two steps are in flight; an answer that comes while
//! a step is being planned waits until that plan is sent, and answers are applied in the order
//! the steps went out.
//!
//! While steps are in flight, submissions and cancellations are still handled, so the queue
//! fills while the engine works; each raises the engine's interrupt, which ends a multi-step
//! decode after the decode step it is in, so a newcomer is admitted one decode step later,
//! not `decode_steps`. When a step ends with work left, the next starts at once; when every
//! job is backing off, a timer wakes the loop; when there is nothing to do, the next
//! submission does.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, MessageResult,
    SpawnHandle, WrapFuture,
};

use crate::engine::{Engine, EngineStep, EngineStepReply};
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
    /// A step's exchanges with the store and the pool are under way.
    planning: bool,
    /// Engine steps sent and not yet answered, with when each began to be planned.
    in_flight: VecDeque<Instant>,
    /// Answers not applied yet: those that came while a step was being planned (applied once
    /// it is sent), in the order their steps went out.
    answered: VecDeque<EngineStepReply>,
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
            planning: false,
            in_flight: VecDeque::new(),
            answered: VecDeque::new(),
            wake: None,
            mailbox_capacity,
        }
    }

    /// Plans a step if one can be planned now, else arms the timer for the next back-off to
    /// end. Called by every arrival and cancellation, and by that timer: while a step is in
    /// flight, each cuts a multi-step decode short, since the next step has new work to plan.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.planning || !self.in_flight.is_empty() {
            self.interrupt.store(true, Ordering::Release);
        }
        self.proceed(ctx);
    }

    /// Plans the next step when one may be planned (none is being planned, and none is in
    /// flight or the scheduler may plan ahead of the one that is) and there is work for it.
    fn proceed(&mut self, ctx: &mut Context<Self>) {
        if self.planning {
            return;
        }
        let may_plan = match self.in_flight.len() {
            0 => true,
            1 => self.scheduler.can_plan_ahead(),
            _ => false,
        };
        if !may_plan {
            // The answer in flight calls this again.
            return;
        }
        let (ready, wake_at) = self.scheduler.readiness(Instant::now());
        if ready {
            self.plan(ctx);
        } else if let Some(at) = wake_at.filter(|_| self.in_flight.is_empty()) {
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

    /// After a step was finished: plans the next at once if it said so, else waits for the
    /// answer in flight, a message or the end of a back-off.
    fn after(&mut self, outcome: StepOutcome, ctx: &mut Context<Self>) {
        if outcome.ready {
            self.proceed(ctx);
        } else if let Some(at) = outcome.wake_at.filter(|_| self.in_flight.is_empty()) {
            self.arm(ctx, at);
        }
    }

    /// The step's one exchange with the store, then its one with the pool, then the engine
    /// step sent (or, with nothing for the engine, the step finished at once).
    fn plan(&mut self, ctx: &mut Context<Self>) {
        self.planning = true;
        // This step's planning sees every arrival so far.
        self.interrupt.store(false, Ordering::Release);
        let started = Instant::now();
        let ops = self.scheduler.begin_step(started);
        let store = self.store.clone();
        let chain = async move {
            if ops.is_empty() {
                return Vec::new();
            }
            store
                .send(StoreStep(ops))
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
        .map(move |(replies, stats), act, ctx| {
            let step = act.scheduler.plan_engine(replies, stats, Instant::now());
            act.planned(step, started, ctx);
        });
        ctx.spawn(chain);
    }

    /// A plan is complete: its engine step goes out, or with none it is finished now; the
    /// answers that came meanwhile are applied; then the next step is planned if it can be.
    fn planned(&mut self, step: Option<EngineStep>, started: Instant, ctx: &mut Context<Self>) {
        self.planning = false;
        let mut outcome = match step {
            Some(step) => {
                self.send(step, started, ctx);
                StepOutcome {
                    ready: true,
                    wake_at: None,
                }
            }
            None => {
                crate::metrics::step_done(started.elapsed().as_secs_f64());
                self.scheduler.finish_step(None, Instant::now())
            }
        };
        while let Some(reply) = self.next_answer() {
            outcome = self.finish(reply);
        }
        self.after(outcome, ctx);
    }

    /// The answer to the oldest step in flight, if it came.
    fn next_answer(&mut self) -> Option<EngineStepReply> {
        let oldest = self.scheduler.oldest_in_flight()?;
        if self.answered.front()?.id != oldest {
            return None;
        }
        self.answered.pop_front()
    }

    fn send(&mut self, step: EngineStep, started: Instant, ctx: &mut Context<Self>) {
        let shape = EngineStepReply::shape_of(&step);
        self.in_flight.push_back(started);
        let answer = self.engine.send(step);
        let answer = async move {
            answer.await.unwrap_or_else(|e| {
                EngineStepReply::failed(shape, &format!("the engine is unavailable: {e}"))
            })
        }
        .into_actor(self)
        .map(|reply, act, ctx| {
            // Kept in the order the steps went out, whatever order the answers are seen in.
            let at = act.answered.partition_point(|r| r.id < reply.id);
            act.answered.insert(at, reply);
            if act.planning {
                return;
            }
            let mut outcome = None;
            while let Some(reply) = act.next_answer() {
                outcome = Some(act.finish(reply));
            }
            if let Some(outcome) = outcome {
                act.after(outcome, ctx);
            }
        });
        ctx.spawn(answer);
    }

    /// Applies the engine's answer to the oldest step in flight.
    fn finish(&mut self, reply: EngineStepReply) -> StepOutcome {
        let started = self
            .in_flight
            .pop_front()
            .expect("an answer is to a step in flight");
        crate::metrics::step_done(started.elapsed().as_secs_f64());
        if reply.forward.is_ok() {
            crate::metrics::forward_done(reply.first_step_seconds);
        }
        self.scheduler.finish_step(Some(reply), Instant::now())
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

/// Submits `n` choices (OpenAI's `n`) of each of a list of requests, all or none; each
/// request's choices compute its prompt once. See
/// [`crate::scheduler::Scheduler::submit_prompts`].
#[derive(Debug, Message)]
#[rtype(result = "Result<Vec<Vec<RequestStream>>, ServeError>")]
pub struct SubmitChoices(pub Vec<GenerateRequest>, pub usize);

impl Handler<SubmitChoices> for Admission {
    type Result = Result<Vec<Vec<RequestStream>>, ServeError>;

    fn handle(&mut self, msg: SubmitChoices, ctx: &mut Context<Self>) -> Self::Result {
        let streams = self.scheduler.submit_prompts(msg.0, msg.1)?;
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
