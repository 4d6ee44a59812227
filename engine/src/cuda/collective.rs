//! One rank's end of a tensor-parallel group's exchanges (`kernels/collective.cu`).
//!
//! Every rank of a group lives in this process, a thread each, so the exchanges need no
//! communication library: each rank's kernels read the peers' buffers directly, through
//! peer-to-peer access between the GPUs (NVLink) or plainly where two ranks share a device
//! (tests on one GPU). A rank registers the two buffers its peers read (its sublayer output and
//! its slice of the logits) and its signal area; [`Collective::connect`] gives every rank the
//! whole group's table. The exchanges are kernels on each rank's stream, so CUDA graphs capture
//! them like any other launch.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use half::bf16;

use super::device::{DPtr, Device, DeviceBuffer};
use super::kernels::{GroupArgs, TP_BLOCKS};
use crate::error::{EngineError, Result};
use crate::model::Shard;

/// The most ranks of one group (`TP_MAX_RANKS`).
pub const MAX_RANKS: usize = 8;

/// Words of one rank's signal area: two phases, a slot per block and rank.
const SIGNAL_WORDS: usize = 2 * TP_BLOCKS as usize * MAX_RANKS;

/// What one rank shows its peers: device addresses in the process's unified address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    signals: u64,
    partials: u64,
    logits: u64,
}

/// How long a rank waits at a [`HostFence`] for the others.
const FENCE_TIMEOUT: Duration = Duration::from_secs(10);

/// A host-side rendezvous of every rank's thread, for ranks that share a GPU (and so a CUDA
/// context). There, anything the driver does that waits for the whole context to go idle
/// (loading a kernel, growing local memory for one) would wait for a peer's exchange kernel,
/// which waits for this rank's launch: a deadlock. So no rank launches an exchange before
/// every rank has queued all it queues before it, nor queues anything after it before every
/// rank has launched it. Ranks on their own GPUs need no fence: one context's wait ends once
/// its own exchanges meet their peers'.
pub struct HostFence {
    world: usize,
    timeout: Duration,
    state: Mutex<FenceState>,
    turned: Condvar,
}

#[derive(Default)]
struct FenceState {
    arrived: usize,
    generation: u64,
    /// Set when a rank gave up waiting: every wait fails until [`HostFence::reset`].
    broken: bool,
}

impl HostFence {
    pub fn new(world: usize) -> Arc<Self> {
        Self::with_timeout(world, FENCE_TIMEOUT)
    }

    /// A fence whose waits give up after `timeout`.
    pub fn with_timeout(world: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(HostFence {
            world,
            timeout,
            state: Mutex::new(FenceState::default()),
            turned: Condvar::new(),
        })
    }

    /// Waits until every rank has arrived; fails after the fence's timeout (a rank that failed
    /// before arriving), leaving the fence broken for the others.
    pub fn wait(&self) -> Result<()> {
        let broken = || EngineError::TensorParallel("a rank did not reach an exchange".into());
        let mut state = self
            .state
            .lock()
            .expect("no panics while holding the fence");
        if state.broken {
            return Err(broken());
        }
        state.arrived += 1;
        if state.arrived == self.world {
            state.arrived = 0;
            state.generation += 1;
            self.turned.notify_all();
            return Ok(());
        }
        let generation = state.generation;
        let (mut state, _) = self
            .turned
            .wait_timeout_while(state, self.timeout, |s| {
                s.generation == generation && !s.broken
            })
            .expect("no panics while holding the fence");
        if state.generation != generation {
            return Ok(());
        }
        state.broken = true;
        self.turned.notify_all();
        Err(broken())
    }

    /// Back to its first state, once no rank waits (after every rank's failed step is over).
    pub fn reset(&self) {
        *self
            .state
            .lock()
            .expect("no panics while holding the fence") = FenceState::default();
    }
}

/// One rank's signals, epochs and copy of the group's table.
pub struct Collective {
    shard: Shard,
    fence: Option<Arc<HostFence>>,
    signals: DeviceBuffer,
    epochs: DeviceBuffer,
    timed_out: DeviceBuffer,
    /// `TpPeers`: signal areas, partials, logits, [`MAX_RANKS`] addresses each.
    table: DeviceBuffer,
}

impl Collective {
    /// `fence`: the group's, where its ranks share a GPU.
    pub fn new(device: &Device, shard: Shard, fence: Option<Arc<HostFence>>) -> Result<Self> {
        if shard.world > MAX_RANKS || shard.rank >= shard.world {
            return Err(EngineError::TensorParallel(format!(
                "rank {} of {}: at most {MAX_RANKS} ranks are supported",
                shard.rank, shard.world
            )));
        }
        let collective = Collective {
            shard,
            fence,
            signals: DeviceBuffer::alloc(device, SIGNAL_WORDS * 4, "exchange signals")?,
            epochs: DeviceBuffer::alloc(device, TP_BLOCKS as usize * 4, "exchange epochs")?,
            timed_out: DeviceBuffer::alloc(device, 16, "exchange timeout flag")?,
            table: DeviceBuffer::alloc(device, 3 * MAX_RANKS * 8, "exchange table")?,
        };
        collective.reset(device)?;
        Ok(collective)
    }

    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// This rank's entry in the group's table, with the buffers its peers read.
    pub fn endpoint(&self, partials: DPtr<bf16>, logits: DPtr<f32>) -> Endpoint {
        Endpoint {
            signals: self.signals.ptr::<u32>().addr(),
            partials: partials.addr(),
            logits: logits.addr(),
        }
    }

    /// Gives this rank the group's table, `endpoints[r]` being rank r's.
    pub fn connect(&self, device: &Device, endpoints: &[Endpoint]) -> Result<()> {
        assert_eq!(endpoints.len(), self.shard.world, "one endpoint per rank");
        let mut table = [0u64; 3 * MAX_RANKS];
        for (r, e) in endpoints.iter().enumerate() {
            table[r] = e.signals;
            table[MAX_RANKS + r] = e.partials;
            table[2 * MAX_RANKS + r] = e.logits;
        }
        device.upload(&table, self.table.ptr())?;
        device.synchronize()
    }

    /// Zeroes the signals, epochs and timeout flag: at start-up, and on every rank at once
    /// after a failed step (no exchange may be in flight on any rank).
    pub fn reset(&self, device: &Device) -> Result<()> {
        device.upload(&[0u32; SIGNAL_WORDS], self.signals.ptr())?;
        device.upload(&[0u32; TP_BLOCKS as usize], self.epochs.ptr())?;
        device.upload(&[0u32; 4], self.timed_out.ptr())?;
        device.synchronize()
    }

    /// Whether an exchange gave up waiting for a peer since the last reset (its results are
    /// wrong). Waits for this rank's queued work.
    pub fn timed_out(&self, device: &Device) -> Result<bool> {
        Ok(self.timeout(device)?.is_some())
    }

    /// Where the first exchange that gave up waited, if one did since the last reset.
    pub fn timeout(&self, device: &Device) -> Result<Option<String>> {
        let mut flag = [0u32; 4];
        device.download(self.timed_out.ptr(), &mut flag)?;
        let [set, epoch, place, seen] = flag;
        Ok((set != 0).then(|| {
            format!(
                "rank {} gave up at exchange {epoch} (phase {}, block {}) waiting for rank {}, \
                 whose signal read {seen}",
                self.shard.rank,
                place >> 24,
                (place >> 8) & 0xffff,
                place & 0xff
            )
        }))
    }

    /// Exchanges this rank has run since the last reset (block 0's count). Waits for its
    /// queued work.
    pub fn exchanges(&self, device: &Device) -> Result<u32> {
        let mut epoch = [0u32];
        device.download(self.epochs.ptr(), &mut epoch)?;
        Ok(epoch[0])
    }

    /// Launches an exchange: between two host fences where the ranks share a GPU.
    pub fn launch(&self, exchange: impl FnOnce(GroupArgs) -> Result<()>) -> Result<()> {
        let Some(fence) = &self.fence else {
            return exchange(self.args());
        };
        fence.wait()?;
        let launched = exchange(self.args());
        fence.wait()?;
        launched
    }

    /// Runs `launch` (a graph's) between two host fences where the ranks share a GPU.
    pub fn fenced<T>(&self, launch: impl FnOnce() -> Result<T>) -> Result<T> {
        let Some(fence) = &self.fence else {
            return launch();
        };
        fence.wait()?;
        let launched = launch();
        fence.wait()?;
        launched
    }

    /// The group's host fence, if its ranks share a GPU.
    pub fn fence(&self) -> Option<&Arc<HostFence>> {
        self.fence.as_ref()
    }

    /// The exchange kernels' view of this rank.
    pub fn args(&self) -> GroupArgs {
        GroupArgs {
            table: self.table.ptr(),
            epochs: self.epochs.ptr(),
            timed_out: self.timed_out.ptr(),
            rank: self.shard.rank,
            world: self.shard.world,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::thread;

    use super::*;

    #[test]
    fn a_fence_lets_every_rank_through_each_round_together() {
        let fence = HostFence::new(3);
        let passed = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..3)
            .map(|rank| {
                let (fence, passed) = (fence.clone(), passed.clone());
                thread::spawn(move || {
                    for round in 0..100 {
                        fence.wait().unwrap();
                        passed.lock().unwrap().push((round, rank));
                        fence.wait().unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let passed = passed.lock().unwrap();
        assert_eq!(passed.len(), 300);
        // No rank starts a round before every rank has finished the one before.
        for (i, (round, _)) in passed.iter().enumerate() {
            assert_eq!(*round, i / 3, "{passed:?}");
        }
    }

    #[test]
    fn a_rank_that_never_arrives_breaks_the_fence_until_it_is_reset() {
        let fence = HostFence::with_timeout(2, Duration::from_millis(50));
        assert!(fence.wait().is_err(), "the other rank never came");
        // Broken for everyone, at once, until reset.
        let started = std::time::Instant::now();
        assert!(fence.wait().is_err());
        assert!(started.elapsed() < Duration::from_millis(40));
        fence.reset();
        let other = {
            let fence = fence.clone();
            thread::spawn(move || fence.wait())
        };
        fence.wait().unwrap();
        other.join().unwrap().unwrap();
    }
}
