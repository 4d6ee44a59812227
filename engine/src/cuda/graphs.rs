//! Decode steps replayed as CUDA graphs, one per batch-size bucket.
//!
//! A decode step of `n` rows runs as the graph of the smallest bucket holding `n`, its extra
//! rows padded (see `step_meta`). A bucket's graph is captured the first time it is needed: the
//! launches of one decode pass are recorded, not run, then instantiated and replayed. A graph's
//! first node spreads the step's metadata, copied to a fixed device blob just before each
//! replay, into the typed buffers every later node reads, so nothing in a graph is ever
//! updated; a graph that samples ends with the sampling, into the picks slot the metadata
//! names. Each graph knows how many kernels it holds, cuBLAS's included.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUgraphNodeType, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, DriverError};

use super::device::Device;
use crate::error::Result;

/// Batch sizes a decode graph is captured for.
pub const BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// The key of a decode graph: its bucket, whether its rows are a verification's positions whose
/// k and v are stored before attention (`AttentionMode::Decode::append_first`), its attention's
/// splits (fewer where every row is short: `forward::decode_splits_within`), and whether it
/// samples every row after the logits.
pub fn key(bucket: usize, append_first: bool, splits: usize, samples: bool) -> usize {
    bucket | (samples as usize) << 19 | (append_first as usize) << 20 | splits << 21
}

/// The smallest bucket holding `rows` rows, if any does and the step fits the workspaces.
pub fn bucket(rows: usize, max_rows: usize) -> Option<usize> {
    BUCKETS
        .into_iter()
        .find(|&b| b >= rows)
        .filter(|&b| b <= max_rows)
}

/// A graph owned by one backend, and the kernels it holds.
struct Graph(CudaGraph, usize);

// SAFETY: a graph is only launched through `&mut` access to the backend that owns it, so no
// two threads ever use it at once; CUDA requires no more.
unsafe impl Send for Graph {}

#[derive(Default)]
pub struct DecodeGraphs {
    graphs: HashMap<usize, Graph>,
}

impl DecodeGraphs {
    /// Whether the graph of `key` is captured.
    pub fn has(&self, key: usize) -> bool {
        self.graphs.contains_key(&key)
    }

    /// Replays the graph of `key` ([`key`]), first capturing `record` into it if it has none.
    pub fn replay(
        &mut self,
        device: &Device,
        key: usize,
        record: impl FnOnce() -> Result<()>,
    ) -> Result<Replay> {
        let (graph, captured) = match self.graphs.entry(key) {
            Entry::Occupied(graph) => (graph.into_mut(), false),
            Entry::Vacant(slot) => {
                let graph = capture(device, record)?;
                let kernels = kernel_nodes(&graph)?;
                (slot.insert(Graph(graph, kernels)), true)
            }
        };
        graph.0.launch()?;
        Ok(Replay {
            kernels: graph.1,
            captured,
        })
    }
}

/// What a replay ran.
#[derive(Debug, Clone, Copy)]
pub struct Replay {
    /// Kernels in the graph.
    pub kernels: usize,
    /// Whether the graph was captured for this replay.
    pub captured: bool,
}

/// The kernel nodes of a graph.
fn kernel_nodes(graph: &CudaGraph) -> std::result::Result<usize, DriverError> {
    let mut count = 0usize;
    // SAFETY: the graph is alive; the first call only counts, the second fills `count` nodes.
    unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut count) }.result()?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    unsafe { sys::cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut count) }.result()?;
    let mut kernels = 0;
    for node in &nodes[..count] {
        let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to the live graph.
        unsafe { sys::cuGraphNodeGetType(*node, &mut kind) }.result()?;
        kernels += (kind == CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL) as usize;
    }
    Ok(kernels)
}

pub(super) fn capture(device: &Device, record: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bucket_kind_and_split_count_has_its_own_key() {
        let mut keys = std::collections::HashSet::new();
        for bucket in BUCKETS {
            for append_first in [false, true] {
                for splits in 1..=128 {
                    for samples in [false, true] {
                        assert!(keys.insert(key(bucket, append_first, splits, samples)));
                    }
                }
            }
        }
    }
}
