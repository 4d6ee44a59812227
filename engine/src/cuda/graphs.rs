//! Decode steps replayed as CUDA graphs, one per batch-size bucket.
//!
//! A decode step of `n` rows runs as the graph of the smallest bucket holding `n`, its extra
//! rows padded (see `step_meta`). A bucket's graph is captured the first time it is needed: the
//! launches of one decode pass are recorded, not run, then instantiated and replayed. Replays
//! read the step's metadata from the buffers `step_meta` refills before each one, so nothing in
//! a graph is ever updated.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::device::Device;
use crate::error::Result;

/// Batch sizes a decode graph is captured for.
pub const BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The smallest bucket holding `rows` rows, if any does and the step fits the workspaces.
pub fn bucket(rows: usize, max_rows: usize) -> Option<usize> {
    BUCKETS
        .into_iter()
        .find(|&b| b >= rows)
        .filter(|&b| b <= max_rows)
}

/// A graph owned by one backend.
struct Graph(CudaGraph);

// SAFETY: a graph is only launched through `&mut` access to the backend that owns it, so no
// two threads ever use it at once; CUDA requires no more.
unsafe impl Send for Graph {}

#[derive(Default)]
pub struct DecodeGraphs {
    graphs: HashMap<usize, Graph>,
}

impl DecodeGraphs {
    /// Replays the graph of `bucket`, first capturing `record` into it if it has none.
    pub fn replay(
        &mut self,
        device: &Device,
        bucket: usize,
        record: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let graph = match self.graphs.entry(bucket) {
            Entry::Occupied(graph) => graph.into_mut(),
            Entry::Vacant(slot) => slot.insert(Graph(capture(device, record)?)),
        };
        Ok(graph.0.launch()?)
    }
}

fn capture(device: &Device, record: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    let stream = device.stream();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let recorded = record();
    // Capture ends whatever happened, so the stream is usable again.
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    recorded?;
    let graph = graph?.expect("a capture that recorded launches yields a graph");
    graph.upload()?;
    Ok(graph)
}
