//! A request's event channel: one sender (the scheduler's job), one receiver (the caller's
//! [`crate::RequestStream`]).
//!
//! A step sends one delivery to every running request, so this is on the scheduler's path once a
//! token a request: a lock over a queue and the receiver's waker, taken once a send and once a
//! read, and a flag the scheduler's sweep reads without the lock to see a caller gone. (tokio's
//! unbounded channel, which this replaces, costs twice the time a token in a loop over 256 of them,
//! and its queue's blocks, 32 slots each, are allocated and freed as tokens pass.) A step's token
//! deliveries ([`Sender::send_later`]) leave the waiting receivers' wakers in a list that
//! [`Waking`] wakes, from a thread of its own when the step has many: the scheduler's thread
//! does not wake hundreds of tasks on other threads itself.
//!
//! Closing: dropping the sender ends the stream once its queue is read; dropping the receiver
//! makes [`Sender::is_closed`] true and every later send return its value.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Poll, Waker};

use parking_lot::Mutex;

struct State<T> {
    queue: VecDeque<T>,
    /// The receiver's, while it waits for a delivery.
    waker: Option<Waker>,
    sender_alive: bool,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    receiver_gone: GoneFlag,
}

/// A flag on a cache line of its own: the scheduler reads it for every request every step,
/// and beside the lock the caller's thread takes at every read it would be moved back and
/// forth between their cores.
#[repr(align(64))]
struct GoneFlag(AtomicBool);

pub(crate) struct Sender<T>(Arc<Shared<T>>);

pub(crate) struct Receiver<T>(Arc<Shared<T>>);

pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            waker: None,
            sender_alive: true,
        }),
        receiver_gone: GoneFlag(AtomicBool::new(false)),
    });
    (Sender(shared.clone()), Receiver(shared))
}

impl<T> Sender<T> {
    /// Queues `value` for the receiver and wakes it; gives the value back if the receiver is
    /// gone.
    pub fn send(&self, value: T) -> Result<(), T> {
        if let Some(waker) = self.queue(value)? {
            waker.wake();
        }
        Ok(())
    }

    /// Queues `value` for the receiver and leaves its waker with `waking`, which wakes it with
    /// the rest of the step's ([`Waking::wake`]); gives the value back if the receiver is gone.
    pub fn send_later(&self, value: T, waking: &mut Waking) -> Result<(), T> {
        if let Some(waker) = self.queue(value)? {
            waking.pending.push(waker);
        }
        Ok(())
    }

    /// Queues `value`, returning the receiver's waker if it waits.
    fn queue(&self, value: T) -> Result<Option<Waker>, T> {
        let mut state = self.0.state.lock();
        if self.0.receiver_gone.0.load(Ordering::Relaxed) {
            return Err(value);
        }
        state.queue.push_back(value);
        Ok(state.waker.take())
    }

    /// Whether the receiver has been dropped (the caller went away).
    pub fn is_closed(&self) -> bool {
        self.0.receiver_gone.0.load(Ordering::Acquire)
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.0.state.lock();
            state.sender_alive = false;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Receiver<T> {
    /// The next delivery, waiting for one; `None` once the sender is gone and the queue read.
    pub async fn recv(&mut self) -> Option<T> {
        poll_fn(|cx| {
            let mut state = self.0.state.lock();
            if let Some(value) = state.queue.pop_front() {
                return Poll::Ready(Some(value));
            }
            if !state.sender_alive {
                return Poll::Ready(None);
            }
            match &mut state.waker {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                slot => *slot = Some(cx.waker().clone()),
            }
            Poll::Pending
        })
        .await
    }

    /// The next delivery if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Option<T> {
        self.0.state.lock().queue.pop_front()
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        // Under the lock, so that no send queues a value after the queue is emptied here.
        let undelivered = {
            let mut state = self.0.state.lock();
            self.0.receiver_gone.0.store(true, Ordering::Release);
            state.waker = None;
            std::mem::take(&mut state.queue)
        };
        drop(undelivered);
    }
}

/// A thread that wakes the receivers a step delivered to: the scheduler's thread hands it one
/// list a step instead of waking each receiver itself. Waking a task that runs on another
/// thread (an HTTP worker's) moves a few cache lines between cores, and a system call where
/// that thread sleeps; at 256 requests a step that was a quarter of the scheduler's thread.
/// The thread starts with the first list handed to it.
///
/// A hand-over costs a channel send and, the wake thread asleep, a system call (a few µs on
/// a VM), and a hop's delay to each token: a step of few requests wakes them itself.
#[derive(Default)]
pub(crate) struct Waking {
    /// The wakers of the step's deliveries so far ([`Sender::send_later`]).
    pending: Vec<Waker>,
    thread: Option<WakeThread>,
}

/// The fewest wakes a step hands to the wake thread.
const WAKE_THREAD_FROM: usize = 16;

struct WakeThread {
    to_thread: std::sync::mpsc::Sender<Vec<Waker>>,
    /// Lists the thread has emptied, for the next step's wakes.
    back: std::sync::mpsc::Receiver<Vec<Waker>>,
    handle: std::thread::JoinHandle<()>,
}

impl WakeThread {
    fn spawn() -> std::io::Result<Self> {
        let (to_thread, lists) = std::sync::mpsc::channel::<Vec<Waker>>();
        let (give_back, back) = std::sync::mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("snapserve-wakes".into())
            .spawn(move || {
                for mut wakes in lists {
                    wakes.drain(..).for_each(Waker::wake);
                    // The scheduler may be gone; the list is then dropped here.
                    let _ = give_back.send(wakes);
                }
            })?;
        Ok(WakeThread {
            to_thread,
            back,
            handle,
        })
    }
}

impl Waking {
    /// Wakes the receivers delivered to since the last call: a few on this thread, more on
    /// the wake thread (on this one where that thread could not be started).
    pub fn wake(&mut self) {
        let wakes = &mut self.pending;
        if wakes.len() < WAKE_THREAD_FROM {
            wakes.drain(..).for_each(Waker::wake);
            return;
        }
        if self.thread.is_none() {
            match WakeThread::spawn() {
                Ok(thread) => self.thread = Some(thread),
                Err(e) => {
                    tracing::warn!("waking callers on the scheduler's thread: {e}");
                    wakes.drain(..).for_each(Waker::wake);
                    return;
                }
            }
        }
        let thread = self.thread.as_ref().expect("started above");
        let empty = thread.back.try_recv().unwrap_or_default();
        let full = std::mem::replace(wakes, empty);
        if let Err(std::sync::mpsc::SendError(full)) = thread.to_thread.send(full) {
            full.into_iter().for_each(Waker::wake);
        }
    }
}

impl Drop for Waking {
    /// Every list handed over is woken before this returns.
    fn drop(&mut self) {
        if let Some(WakeThread {
            to_thread, handle, ..
        }) = self.thread.take()
        {
            drop(to_thread);
            let _ = handle.join();
        }
    }
}

impl std::fmt::Debug for Waking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waking").finish_non_exhaustive()
    }
}

impl<T> std::fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender")
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl<T> std::fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Wake};

    use super::*;

    struct Count(std::sync::atomic::AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll_recv(rx: &mut Receiver<u32>, waker: &Waker) -> Poll<Option<u32>> {
        let mut cx = Context::from_waker(waker);
        let fut = std::pin::pin!(rx.recv());
        fut.poll(&mut cx)
    }

    #[test]
    fn deliveries_arrive_in_order_then_the_end() {
        let (tx, mut rx) = channel();
        for i in 0..100 {
            tx.send(i).unwrap();
        }
        assert_eq!(rx.try_recv(), Some(0));
        drop(tx);
        let count = Arc::new(Count(Default::default()));
        let waker = Waker::from(count.clone());
        for i in 1..100 {
            assert_eq!(poll_recv(&mut rx, &waker), Poll::Ready(Some(i)));
        }
        assert_eq!(poll_recv(&mut rx, &waker), Poll::Ready(None));
        assert_eq!(rx.try_recv(), None);
    }

    #[test]
    fn a_waiting_receiver_is_woken_by_a_send_and_by_the_sender_leaving() {
        let (tx, mut rx) = channel();
        let count = Arc::new(Count(Default::default()));
        let waker = Waker::from(count.clone());
        assert_eq!(poll_recv(&mut rx, &waker), Poll::Pending);
        tx.send(7).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(poll_recv(&mut rx, &waker), Poll::Ready(Some(7)));
        assert_eq!(poll_recv(&mut rx, &waker), Poll::Pending);
        drop(tx);
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        assert_eq!(poll_recv(&mut rx, &waker), Poll::Ready(None));
    }

    #[test]
    fn a_gone_receiver_closes_the_sender_and_refuses_sends() {
        let (tx, rx) = channel();
        tx.send(1).unwrap();
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(2), Err(2));
    }

    #[test]
    fn a_step_of_few_wakes_wakes_them_itself() {
        let count = Arc::new(Count(Default::default()));
        let mut waking = Waking::default();
        waking.pending = (0..3).map(|_| Waker::from(count.clone())).collect();
        waking.wake();
        assert!(waking.pending.is_empty());
        assert_eq!(count.0.load(Ordering::SeqCst), 3);
        assert!(waking.thread.is_none(), "no thread for a few wakes");
    }

    #[test]
    fn wakes_handed_to_the_wake_thread_reach_receivers_on_another_thread() {
        // Receivers parked on a real executor: each value sent with `send_later` arrives once
        // its wake is handed over (the senders stay until every value is counted: their drop
        // would wake the receivers by itself), and the end after it.
        const RECEIVERS: usize = WAKE_THREAD_FROM;
        let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = received.clone();
        let senders_and_receivers: Vec<_> = (0..RECEIVERS).map(|_| channel::<u32>()).collect();
        let (senders, receivers): (Vec<_>, Vec<_>) = senders_and_receivers.into_iter().unzip();
        let readers = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(async move {
                let local = tokio::task::LocalSet::new();
                local
                    .run_until(async move {
                        let tasks: Vec<_> = receivers
                            .into_iter()
                            .map(|mut rx| {
                                let counted = counted.clone();
                                tokio::task::spawn_local(async move {
                                    let mut got = Vec::new();
                                    while let Some(v) = rx.recv().await {
                                        got.push(v);
                                        counted.fetch_add(1, Ordering::SeqCst);
                                    }
                                    got
                                })
                            })
                            .collect();
                        let mut all = Vec::new();
                        for task in tasks {
                            all.push(task.await.unwrap());
                        }
                        all
                    })
                    .await
            })
        });
        let mut waking = Waking::default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        for step in 0..200 {
            for tx in &senders {
                tx.send_later(step, &mut waking).unwrap();
            }
            waking.wake();
            assert!(waking.pending.is_empty());
            // Each step's values are read before the next is sent: the receivers wait each
            // time, and only a wake brings them back.
            while received.load(Ordering::SeqCst) < RECEIVERS * (step as usize + 1) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{} of {} values arrived: a wake was lost",
                    received.load(Ordering::SeqCst),
                    RECEIVERS * (step as usize + 1)
                );
                std::thread::yield_now();
            }
        }
        drop(senders);
        let got = readers.join().unwrap();
        assert_eq!(got.len(), RECEIVERS);
        assert!(waking.thread.is_some(), "the lists went to the wake thread");
        for values in got {
            assert_eq!(values, (0..200).collect::<Vec<_>>());
        }
    }

    #[test]
    fn threads_lose_no_delivery_and_no_wake() {
        // A sender thread and a receiver parked on a real executor's waker: every value arrives,
        // then the end.
        let (tx, mut rx) = channel::<u32>();
        let sender = std::thread::spawn(move || {
            for i in 0..20_000 {
                tx.send(i).unwrap();
                if i % 64 == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let received = rt.block_on(async {
            let mut next = 0;
            while let Some(value) = rx.recv().await {
                assert_eq!(value, next);
                next += 1;
            }
            next
        });
        sender.join().unwrap();
        assert_eq!(received, 20_000);
    }
}
