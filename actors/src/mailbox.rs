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
//!
//! A thread that reads many streams (an HTTP worker) may install an [`Inbox`]
//! ([`install_inbox`]): a stream first read there is then delivered to through it. The
//! scheduler appends each delivery to the inbox, a list only that thread and the scheduler
//! share, and wakes one task, the inbox's, once a step; that task puts each delivery in its
//! stream's queue and wakes the stream's reader, both on the reader's own thread. Without
//! it, every delivery took a lock whose line the reader's thread held and woke a task on
//! that thread: a round trip between cores for every request every step.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
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
    read_mostly: ReadMostly<T>,
}

/// What the scheduler reads for every request every step and rarely changes, on a cache line
/// of its own: beside the lock the caller's thread takes at every read it would be moved back
/// and forth between their cores.
#[repr(align(64))]
struct ReadMostly<T> {
    receiver_gone: AtomicBool,
    /// The inbox of the thread that first read the stream, if that thread has one and is not
    /// the thread the stream was made on (the sender's: there it reads its queue directly).
    inbox: OnceLock<Arc<Inbox<T>>>,
    /// The thread the stream was made on ([`thread_tag`]).
    made_on: usize,
}

/// A number for the current thread, unique among the threads alive (its thread-local's
/// address); cheaper to read than `std::thread::current().id()`.
fn thread_tag() -> usize {
    thread_local!(static TAG: u8 = const { 0 });
    TAG.with(|tag| std::ptr::from_ref(tag) as usize)
}

pub(crate) struct Sender<T>(Arc<Shared<T>>);

pub(crate) struct Receiver<T> {
    shared: Arc<Shared<T>>,
    /// The stream's deliveries go through an inbox, or this thread has none to offer.
    routed: bool,
}

pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            waker: None,
            sender_alive: true,
        }),
        read_mostly: ReadMostly {
            receiver_gone: AtomicBool::new(false),
            inbox: OnceLock::new(),
            made_on: thread_tag(),
        },
    });
    (
        Sender(shared.clone()),
        Receiver {
            shared,
            routed: false,
        },
    )
}

impl<T> Shared<T> {
    /// Queues `value`, returning the receiver's waker if it waits; the value back if the
    /// receiver is gone.
    fn queue(&self, value: T) -> Result<Option<Waker>, T> {
        let mut state = self.state.lock();
        if self.read_mostly.receiver_gone.load(Ordering::Relaxed) {
            return Err(value);
        }
        state.queue.push_back(value);
        Ok(state.waker.take())
    }

    /// The sender is gone: the stream ends once its queue is read.
    fn close(&self) {
        let waker = {
            let mut state = self.state.lock();
            state.sender_alive = false;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
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

    /// Queues `value` for the receiver and leaves its waker (or its inbox's) with `waking`,
    /// which wakes it with the rest of the step's ([`Waking::wake`]); gives the value back if
    /// the receiver is gone.
    pub fn send_later(&self, value: T, waking: &mut Waking) -> Result<(), T> {
        if let Some(waker) = self.queue(value)? {
            waking.pending.push(waker);
        }
        Ok(())
    }

    /// Queues `value` in the receiver's inbox, or in its queue where it has none, returning
    /// the waker to wake (the inbox's task, or the receiver) if it waits.
    fn queue(&self, value: T) -> Result<Option<Waker>, T> {
        let shared = &self.0;
        if shared.read_mostly.receiver_gone.load(Ordering::Relaxed) {
            return Err(value);
        }
        match shared.read_mostly.inbox.get() {
            Some(inbox) => match inbox.push(Item::Value(NonNull::from(&**shared), value)) {
                Ok(waker) => Ok(waker),
                // The inbox's thread has gone: straight to the stream.
                Err(Item::Value(_, value)) => shared.queue(value),
                Err(Item::Close(_)) => unreachable!("a value was pushed"),
            },
            None => shared.queue(value),
        }
    }

    /// Whether the receiver has been dropped (the caller went away).
    pub fn is_closed(&self) -> bool {
        self.0.read_mostly.receiver_gone.load(Ordering::Acquire)
    }
}

impl<T> Drop for Sender<T> {
    /// Through the inbox when the deliveries go there, after them; it keeps the stream's
    /// state alive until the inbox's task has delivered every value sent before.
    fn drop(&mut self) {
        let closed = match self.0.read_mostly.inbox.get() {
            Some(inbox) => inbox.push(Item::Close(self.0.clone())),
            None => Err(Item::Close(self.0.clone())),
        };
        match closed {
            Ok(Some(waker)) => waker.wake(),
            Ok(None) => {}
            // No inbox, or its thread has gone: straight to the stream.
            Err(_) => self.0.close(),
        }
    }
}

impl<T: Send + 'static> Receiver<T> {
    /// The next delivery, waiting for one; `None` once the sender is gone and the queue read.
    pub async fn recv(&mut self) -> Option<T> {
        if !self.routed {
            self.routed = true;
            if self.shared.read_mostly.made_on != thread_tag()
                && let Some(inbox) = Inbox::current()
            {
                // Values sent before this went straight to the queue, ahead of any the
                // inbox will bring.
                let _ = self.shared.read_mostly.inbox.set(inbox);
            }
        }
        poll_fn(|cx| {
            let mut state = self.shared.state.lock();
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
}

impl<T> Receiver<T> {
    /// The next delivery if one is queued, without waiting (one still in an inbox is not).
    pub fn try_recv(&mut self) -> Option<T> {
        self.shared.state.lock().queue.pop_front()
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        // Under the lock, so that no send queues a value after the queue is emptied here.
        let undelivered = {
            let mut state = self.shared.state.lock();
            self.shared
                .read_mostly
                .receiver_gone
                .store(true, Ordering::Release);
            state.waker = None;
            std::mem::take(&mut state.queue)
        };
        drop(undelivered);
    }
}

/// A delivery waiting in an inbox.
enum Item<T> {
    /// A value for the stream whose state this points to. Its sender's [`Item::Close`],
    /// which holds the state, comes after it in the same inbox, so the state outlives it.
    Value(NonNull<Shared<T>>, T),
    Close(Arc<Shared<T>>),
}

// SAFETY: an item is a value of `T` and a reference to a stream's state, itself `Send` and
// `Sync` when `T` is `Send` (its fields are behind a lock or atomic); the pointer is only
// followed while the state is alive (see `Item::Value`).
unsafe impl<T: Send> Send for Item<T> {}

/// The deliveries of the streams first read on one thread, on their way to that thread
/// ([`install_inbox`]).
pub(crate) struct Inbox<T> {
    state: Mutex<InboxState<T>>,
}

struct InboxState<T> {
    items: Vec<Item<T>>,
    /// The inbox's task's, while it waits for items.
    waker: Option<Waker>,
    /// The task is gone (its thread's runtime ended): senders go straight to their streams.
    gone: bool,
}

thread_local! {
    /// This thread's inboxes, one per delivery type.
    static INBOXES: RefCell<Vec<(TypeId, Arc<dyn Any + Send + Sync>)>> =
        const { RefCell::new(Vec::new()) };
}

/// Gives the current thread an inbox for streams of `T`, with a task on the thread's local
/// task set (`tokio::task::spawn_local`: call it inside one, as an actix worker runs) that
/// delivers what arrives in it. Streams first read on this thread afterwards are delivered to
/// through it, and must be read on this thread's task set. Does nothing where the thread
/// already has a working one.
pub(crate) fn install_inbox<T: Send + 'static>() {
    if Inbox::<T>::current().is_some() {
        return;
    }
    let inbox = Arc::new(Inbox::<T> {
        state: Mutex::new(InboxState {
            items: Vec::new(),
            waker: None,
            gone: false,
        }),
    });
    INBOXES.with(|inboxes| {
        let mut inboxes = inboxes.borrow_mut();
        inboxes.retain(|(id, _)| *id != TypeId::of::<T>());
        inboxes.push((TypeId::of::<T>(), inbox.clone()));
    });
    tokio::task::spawn_local(deliver(inbox));
}

impl<T: Send + 'static> Inbox<T> {
    /// This thread's working inbox for `T`, if it has one.
    fn current() -> Option<Arc<Self>> {
        INBOXES
            .try_with(|inboxes| {
                let inboxes = inboxes.borrow();
                let (_, inbox) = inboxes.iter().find(|(id, _)| *id == TypeId::of::<T>())?;
                let inbox = inbox.clone().downcast::<Inbox<T>>().ok()?;
                let gone = inbox.state.lock().gone;
                (!gone).then_some(inbox)
            })
            .ok()
            .flatten()
    }
}

impl<T> Inbox<T> {
    /// Appends `item`, returning the inbox task's waker if it waits; the item back if the
    /// task is gone.
    fn push(&self, item: Item<T>) -> Result<Option<Waker>, Item<T>> {
        let mut state = self.state.lock();
        if state.gone {
            return Err(item);
        }
        if state.items.is_empty() {
            // The list was the inbox's task's last; a step's items are stored one by one,
            // each behind a lock, which waits out each line's trip from the other core.
            crate::lines::own_lines(state.items.spare_capacity_mut());
        }
        state.items.push(item);
        Ok(state.waker.take())
    }
}

/// The inbox's task: puts each item in its stream and wakes the stream's reader, a batch at a
/// time, until the thread's task set drops it. Built so that dropping it marks the inbox gone
/// even if it never ran.
fn deliver<T>(inbox: Arc<Inbox<T>>) -> impl Future<Output = ()> {
    let gone = Gone(inbox);
    async move {
        let inbox = &gone.0;
        let mut batch = Vec::new();
        loop {
            poll_fn(|cx| {
                let mut state = inbox.state.lock();
                if state.items.is_empty() {
                    match &mut state.waker {
                        Some(waker) if waker.will_wake(cx.waker()) => {}
                        slot => *slot = Some(cx.waker().clone()),
                    }
                    return Poll::Pending;
                }
                std::mem::swap(&mut state.items, &mut batch);
                Poll::Ready(())
            })
            .await;
            // Written on the scheduler's thread: read at once, not line by line between locks.
            crate::lines::pull_lines(&batch);
            for item in batch.drain(..) {
                match item {
                    Item::Value(shared, value) => {
                        // SAFETY: the sender's `Item::Close` is behind this item in the inbox and
                        // holds the state; nothing else frees it while the sender lives.
                        let shared = unsafe { shared.as_ref() };
                        if let Ok(Some(waker)) = shared.queue(value) {
                            waker.wake();
                        }
                    }
                    Item::Close(shared) => shared.close(),
                }
            }
        }
    }
}

/// Marks its inbox gone when dropped (its task ended with the thread's task set). What is
/// still in it is dropped unread: the streams' readers ran on the same task set and are gone.
struct Gone<T>(Arc<Inbox<T>>);

impl<T> Drop for Gone<T> {
    fn drop(&mut self) {
        let items = {
            let mut state = self.0.state.lock();
            state.gone = true;
            std::mem::take(&mut state.items)
        };
        drop(items);
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
        let readers = on_reader_thread(false, move || read_all(receivers, counted));
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
            wait_for(&received, RECEIVERS * (step as usize + 1), deadline);
        }
        drop(senders);
        let got = readers.join().unwrap();
        assert_eq!(got.len(), RECEIVERS);
        assert!(waking.thread.is_some(), "the lists went to the wake thread");
        for values in got {
            assert_eq!(values, (0..200).collect::<Vec<_>>());
        }
    }

    /// Runs `body` on a thread of its own inside a local task set, with an inbox for `u32`
    /// streams if `inbox` (as an HTTP worker runs); answers what `body` returned.
    fn on_reader_thread<F, Fut, R>(inbox: bool, body: F) -> std::thread::JoinHandle<R>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, async move {
                if inbox {
                    install_inbox::<u32>();
                }
                body().await
            })
        })
    }

    fn on_inbox_thread<F, Fut, R>(body: F) -> std::thread::JoinHandle<R>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        on_reader_thread(true, body)
    }

    /// Reads every receiver to its end, each on a task of its own on the current local task
    /// set, counting each value into `counted` as it arrives: what each read.
    async fn read_all(
        receivers: Vec<Receiver<u32>>,
        counted: Arc<std::sync::atomic::AtomicUsize>,
    ) -> Vec<Vec<u32>> {
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
    }

    /// Waits until `received` counts `want` values, failing past `deadline`.
    fn wait_for(
        received: &std::sync::atomic::AtomicUsize,
        want: usize,
        deadline: std::time::Instant,
    ) {
        while received.load(Ordering::SeqCst) < want {
            assert!(
                std::time::Instant::now() < deadline,
                "{} of {want} values arrived: a delivery or a wake was lost",
                received.load(Ordering::SeqCst),
            );
            std::thread::yield_now();
        }
    }

    #[test]
    fn streams_read_through_an_inbox_get_every_value_in_order_then_the_end() {
        // Values sent before a stream is first read go straight to it, the rest through the
        // reading thread's inbox: each stream reads them all, in order, then its end. A step's
        // deliveries wake one task, the inbox's: the wake thread is never needed.
        const STREAMS: usize = 4 * WAKE_THREAD_FROM;
        const STEPS: u32 = 200;
        let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = received.clone();
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..STREAMS).map(|_| channel()).unzip();
        for tx in &senders {
            tx.send(0).unwrap();
        }
        let readers = on_inbox_thread(move || read_all(receivers, counted));
        let mut waking = Waking::default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        for step in 1..STEPS {
            for tx in &senders {
                tx.send_later(step, &mut waking).unwrap();
            }
            assert!(
                waking.pending.len() <= 1,
                "{} wakes for one step: the deliveries did not go through the inbox",
                waking.pending.len()
            );
            waking.wake();
            wait_for(&received, STREAMS * (step as usize + 1), deadline);
        }
        drop(senders);
        let got = readers.join().unwrap();
        assert!(waking.thread.is_none(), "the wake thread was never needed");
        for values in got {
            assert_eq!(values, (0..STEPS).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_reader_gone_with_deliveries_in_the_inbox_drops_them_and_closes_its_sender() {
        // The reader leaves after its first value; what the sender sent meanwhile is in the
        // inbox or queued, and is dropped; the sender sees the stream closed.
        let (tx, mut rx) = channel::<u32>();
        let (first_read, read) = std::sync::mpsc::channel();
        let reader = on_inbox_thread(move || async move {
            let first = rx.recv().await;
            first_read.send(()).unwrap();
            // Let the inbox's task run a while longer with the stream gone.
            drop(rx);
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
            first
        });
        let mut waking = Waking::default();
        // The first read has begun once the stream is routed; sent before, values go straight.
        tx.send_later(1, &mut waking).unwrap();
        waking.wake();
        read.recv().unwrap();
        for v in 2..1000 {
            if tx.send_later(v, &mut waking).is_err() {
                break;
            }
            waking.wake();
        }
        assert_eq!(reader.join().unwrap(), Some(1));
        assert!(tx.is_closed());
        assert_eq!(tx.send(5), Err(5));
    }

    #[test]
    fn sends_after_the_inbox_thread_ended_go_straight_to_the_stream() {
        // A stream first read on a thread whose task set has since ended (its inbox gone) is
        // delivered to directly, and its end arrives.
        let (tx, rx) = channel::<u32>();
        let mut waking = Waking::default();
        let rx = on_inbox_thread(move || async move {
            let mut rx = rx;
            // Routed by its first read, which finds nothing yet.
            let waker = Waker::from(Arc::new(Count(Default::default())));
            assert_eq!(poll_recv(&mut rx, &waker), Poll::Pending);
            rx
        })
        .join()
        .unwrap();
        assert!(
            tx.0.read_mostly.inbox.get().is_some(),
            "the first read routed it"
        );
        tx.send_later(7, &mut waking).unwrap();
        waking.wake();
        drop(tx);
        let mut rx = rx;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let got = rt.block_on(async {
            let mut got = Vec::new();
            let all = async {
                while let Some(v) = rx.recv().await {
                    got.push(v);
                }
            };
            tokio::time::timeout(std::time::Duration::from_secs(10), all)
                .await
                .expect("the value and the end arrive, not left in the gone inbox");
            got
        });
        assert_eq!(got, vec![7]);
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
