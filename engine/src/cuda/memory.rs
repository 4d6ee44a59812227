//! The memory plan: what the CUDA backend will hold on the device, decided before it allocates
//! anything, and printed at start-up.
//!
//! The budget is `gpu_memory_fraction` of the device's memory, and never more than is free when
//! the backend starts. Out of it come, in order: the weights, the step workspaces, the device
//! snapshot tier and a fixed reserve for what CUDA itself takes (modules, graphs, cuBLAS); the
//! working pool gets what is asked of the rest. A model that leaves no room for a pool able to
//! hold one full step is refused with an error that shows the whole plan.

use std::fmt;

use policy::PoolSize;

use crate::error::{EngineError, Result};

/// Kept back for CUDA's own allocations: module code, graph executables, cuBLAS's workspace and
/// the driver's per-thread stacks.
const RESERVE_BYTES: u64 = 512 << 20;

/// What the plan is computed from.
#[derive(Debug, Clone)]
pub struct PlanInputs {
    pub device_name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub gpu_memory_fraction: f64,
    pub weights_bytes: u64,
    pub workspace_bytes: u64,
    pub snapshot_bytes: u64,
    pub pool: PoolSize,
    /// Bytes of one page across all layers, K and V.
    pub page_bytes: u64,
    pub page_tokens: usize,
    /// The fewest pages the pool may have (one full step).
    pub min_pages: usize,
}

/// The device memory the backend takes, by purpose.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    pub device_name: String,
    pub total_bytes: u64,
    pub budget_bytes: u64,
    pub weights_bytes: u64,
    pub workspace_bytes: u64,
    pub snapshot_bytes: u64,
    pub reserve_bytes: u64,
    pub page_bytes: u64,
    pub pool_pages: usize,
}

impl MemoryPlan {
    pub fn new(i: &PlanInputs) -> Result<Self> {
        let budget = ((i.total_bytes as f64 * i.gpu_memory_fraction) as u64).min(i.free_bytes);
        let mut plan = MemoryPlan {
            device_name: i.device_name.clone(),
            total_bytes: i.total_bytes,
            budget_bytes: budget,
            weights_bytes: i.weights_bytes,
            workspace_bytes: i.workspace_bytes,
            snapshot_bytes: i.snapshot_bytes,
            reserve_bytes: RESERVE_BYTES,
            page_bytes: i.page_bytes,
            pool_pages: 0,
        };
        let fixed = plan.weights_bytes + plan.workspace_bytes + plan.snapshot_bytes + RESERVE_BYTES;
        let room = budget.saturating_sub(fixed);
        plan.pool_pages = match i.pool {
            PoolSize::Tokens(tokens) => tokens.div_ceil(i.page_tokens as u64) as usize,
            PoolSize::MemoryFraction(f) => {
                ((room as f64 * f / i.page_bytes as f64) as usize).saturating_sub(1)
            }
        };
        let needed = fixed + (plan.pool_pages.max(i.min_pages) + 1) as u64 * i.page_bytes;
        if needed > budget {
            return Err(EngineError::DoesNotFit {
                what: "the weights, workspaces, snapshot tier and a working pool".into(),
                needed_bytes: needed,
                available_bytes: budget,
                plan: plan.summary(),
            });
        }
        plan.pool_pages = plan.pool_pages.max(i.min_pages);
        Ok(plan)
    }

    /// The pool's bytes: its pages and one more that takes the writes of padding rows.
    pub fn pool_bytes(&self) -> u64 {
        (self.pool_pages + 1) as u64 * self.page_bytes
    }

    /// One line per purpose, for error messages.
    fn summary(&self) -> String {
        format!(
            "budget {} of {}: weights {}, workspaces {}, snapshot tier {}, CUDA reserve {}, pool {} pages of {}",
            gib(self.budget_bytes),
            gib(self.total_bytes),
            gib(self.weights_bytes),
            gib(self.workspace_bytes),
            gib(self.snapshot_bytes),
            gib(self.reserve_bytes),
            self.pool_pages,
            mib(self.page_bytes),
        )
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn mib(bytes: u64) -> String {
    format!("{:.3} MiB", bytes as f64 / (1u64 << 20) as f64)
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "memory plan on {} ({} total, budget {}):",
            self.device_name,
            gib(self.total_bytes),
            gib(self.budget_bytes)
        )?;
        let rows = [
            ("weights (bf16)", self.weights_bytes),
            ("step workspaces", self.workspace_bytes),
            ("device snapshot tier", self.snapshot_bytes),
            ("CUDA reserve", self.reserve_bytes),
            ("KV pool", self.pool_bytes()),
        ];
        for (name, bytes) in rows {
            writeln!(f, "  {name:<22} {:>12}", gib(bytes))?;
        }
        write!(
            f,
            "  KV pool: {} pages of {}",
            self.pool_pages,
            mib(self.page_bytes)
        )
    }
}
