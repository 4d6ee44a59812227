//! The CPU backend: an f32 forward pass of a Llama-family model over paged KV.
//!
//! It is the reference the CUDA backend is checked against and the fallback where no GPU
//! exists. One step runs every row's tokens together: the projections see all of the step's
//! tokens as one matrix, attention runs per token and head over each sequence's own pages.
//! Work is spread over a private rayon pool of `threads` threads.

mod attention;
pub mod blocks;
pub mod int8;
pub mod kernels;
pub mod matmul;
#[cfg(test)]
mod test_data;
mod weights;

use std::collections::HashMap;

use cache::{BackingId, KvGeometry, PageClone, PageCopy, Tier, checksum};

use crate::backend::{
    Backend, BackendInfo, HostRun, LogitsWanted, MemoryReport, StepOutput, StepPlan,
};
use crate::error::{EngineError, Result};
use crate::model::{ModelConfig, ModelFiles, Weights};
use attention::{AttentionShape, KvPages, QueryPos};
use weights::CpuWeights;

/// The most KV positions a pool sized by a memory fraction gets on the CPU: f32 pages are
/// large (46 KB a position for SmolLM2-135M) and a CPU decodes few sequences at a time.
pub const CPU_POOL_TOKENS_CAP: usize = 65_536;

/// How to size the CPU backend.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuOptions {
    pub threads: usize,
    pub page_tokens: usize,
    pub num_pages: usize,
    /// Multiply weights kept in the GGUF's blocks by input rows quantized to 8 bits, in
    /// integers ([`int8`], `[engine] quantization = "int8"`), rather than exactly; a folder
    /// without blocks is refused.
    pub int8_inputs: bool,
}

impl CpuOptions {
    /// The options a server configuration asks for. A pool given as a fraction of memory is
    /// that fraction of the memory the system reports available, but no more than every
    /// running sequence at full context needs and no more than [`CPU_POOL_TOKENS_CAP`]
    /// positions (`cache.pool_tokens` sets any size).
    pub fn from_policies(
        engine: &policy::EngineConfig,
        cache: &policy::CachePolicy,
        admission: &policy::AdmissionPolicy,
        model: &ModelConfig,
    ) -> Self {
        let threads = match engine.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let tokens = match cache.pool() {
            policy::PoolSize::Tokens(tokens) => tokens as usize,
            policy::PoolSize::MemoryFraction(fraction) => {
                // f32 keys and values, every layer.
                let per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4;
                let available = available_memory_bytes().unwrap_or(8 << 30);
                let fits = (available as f64 * fraction) as usize / per_token.max(1);
                fits.min(admission.max_running() * model.max_position_embeddings)
                    .min(CPU_POOL_TOKENS_CAP)
            }
        };
        let page_tokens = cache.page_tokens();
        CpuOptions {
            threads,
            page_tokens,
            num_pages: tokens.div_ceil(page_tokens).max(1),
            int8_inputs: engine.quantization == policy::Quantization::Int8,
        }
    }

    /// All available cores, 16-token pages, and enough pages for `tokens` positions.
    pub fn for_tokens(tokens: usize) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            threads,
            page_tokens: 16,
            num_pages: tokens.div_ceil(16),
            int8_inputs: false,
        }
    }
}

/// Activations of one step, kept between steps so steady decoding allocates nothing big.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    projected: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.clear();
    buf.resize(len, 0.0);
}

pub struct CpuBackend {
    config: ModelConfig,
    weights: CpuWeights,
    kv: KvPages,
    /// Snapshot buffers; both tiers are host memory here.
    backings: HashMap<BackingId, CpuBacking>,
    /// Whether each restore since the last `restore_verdicts` read what was saved.
    verdicts: Vec<bool>,
    /// Copies made (at once) and not yet reported by `finished_copies`, by their target.
    copied: Vec<BackingId>,
    info: BackendInfo,
    inv_freq: Vec<f32>,
    pool: rayon::ThreadPool,
    scratch: Scratch,
}

/// One snapshot buffer and the sums of its blocks.
struct CpuBacking {
    tier: Tier,
    data: Vec<f32>,
    /// One per block (a layer's K or V of one page), in snapshot order.
    sums: Vec<u64>,
}

impl CpuBackend {
    /// Loads the weights of `model` as f32 and allocates `options.num_pages` KV pages.
    pub fn load(model: &ModelFiles, options: &CpuOptions) -> Result<Self> {
        let weights = Weights::open(&model.dir)?;
        Self::from_weights(model.config.clone(), &weights, options)
    }

    pub fn from_weights(
        config: ModelConfig,
        weights: &Weights,
        options: &CpuOptions,
    ) -> Result<Self> {
        if options.page_tokens == 0 || options.num_pages == 0 || options.threads == 0 {
            return Err(EngineError::InvalidStep(format!(
                "CPU backend options must be positive: {options:?}"
            )));
        }
        let geometry = KvGeometry {
            layers: config.num_layers,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            page_tokens: options.page_tokens,
            dtype_bytes: 4,
        };
        let info = BackendInfo {
            name: "cpu",
            geometry,
            num_pages: options.num_pages,
            vocab_size: config.vocab_size,
            max_positions: config.max_position_embeddings,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(options.threads)
            .thread_name(|i| format!("snapserve-cpu-{i}"))
            .build()
            .map_err(|e| {
                EngineError::InvalidStep(format!(
                    "cannot start {} CPU threads: {e}",
                    options.threads
                ))
            })?;
        let weights = CpuWeights::load(weights, &config, options.int8_inputs)?;
        if options.int8_inputs && !weights.has_blocks() {
            return Err(EngineError::Quantization(
                "quantization = \"int8\" multiplies weights kept in the GGUF's Q4_1/Q8_0 blocks, \
                 and this model has none: use a folder converted with `snapserve fetch-model \
                 --keep-blocks` (the embedded model's CPU default), or leave it unset"
                    .into(),
            ));
        }
        Ok(Self {
            weights,
            kv: KvPages::new(geometry, options.num_pages),
            backings: HashMap::new(),
            verdicts: Vec::new(),
            copied: Vec::new(),
            inv_freq: config.rope_inv_freq(),
            config,
            info,
            pool,
            scratch: Scratch::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn backing(&mut self, id: BackingId) -> Result<&mut CpuBacking> {
        self.backings
            .get_mut(&id)
            .ok_or_else(|| EngineError::Backing(id.to_string(), "no such buffer".into()))
    }

    /// Blocks of one snapshot page: each layer's K and V.
    fn page_blocks(&self) -> usize {
        2 * self.config.num_layers
    }

    /// Checks that every copy names a page of the pool and a page of a buffer of `len` elements.
    fn check_copies(&self, id: BackingId, len: usize, copies: &[PageCopy]) -> Result<()> {
        let page = self.kv.snapshot_page_elems();
        for copy in copies {
            if copy.pool_page.index() >= self.info.num_pages
                || (copy.snapshot_page as usize + 1) * page > len
            {
                return Err(EngineError::Backing(
                    id.to_string(),
                    format!("copy {copy:?} is out of range"),
                ));
            }
        }
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput> {
        plan.validate(&self.info)?;
        let pool = &self.pool;
        let mut forward = Forward {
            config: &self.config,
            weights: &self.weights,
            kv: &mut self.kv,
            s: &mut self.scratch,
            inv_freq: &self.inv_freq,
        };
        Ok(pool.install(|| forward.run(plan)))
    }

    fn alloc_backing(&mut self, backing: BackingId, tier: Tier, bytes: u64) -> Result<()> {
        if tier == Tier::Disk {
            return Err(EngineError::Backing(
                backing.to_string(),
                "the disk tier holds files, not memory the backend allocates".into(),
            ));
        }
        if self.backings.contains_key(&backing) {
            return Err(EngineError::Backing(
                backing.to_string(),
                "already allocated".into(),
            ));
        }
        let elems = usize::try_from(bytes.div_ceil(4))
            .map_err(|_| EngineError::OutOfMemory(format!("{bytes} bytes")))?;
        let mut data = Vec::new();
        data.try_reserve_exact(elems).map_err(|e| {
            EngineError::OutOfMemory(format!("snapshot buffer of {bytes} bytes: {e}"))
        })?;
        data.resize(elems, 0.0);
        let blocks = elems / self.kv.page_elems().max(1);
        let sums = vec![0; blocks];
        self.backings
            .insert(backing, CpuBacking { tier, data, sums });
        Ok(())
    }

    fn free_backing(&mut self, backing: BackingId) -> Result<()> {
        self.backings
            .remove(&backing)
            .map(drop)
            .ok_or_else(|| EngineError::Backing(backing.to_string(), "no such buffer".into()))
    }

    fn save_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()> {
        let len = self.backing(backing)?.data.len();
        self.check_copies(backing, len, copies)?;
        let (page, block, blocks) = (
            self.kv.snapshot_page_elems(),
            self.kv.page_elems(),
            self.page_blocks(),
        );
        let target = self.backings.get_mut(&backing).expect("checked above");
        for copy in copies {
            let at = copy.snapshot_page as usize * page;
            let data = &mut target.data[at..at + page];
            self.kv.read_page(copy.pool_page, data);
            let first = copy.snapshot_page as usize * blocks;
            for (sum, block) in target.sums[first..first + blocks]
                .iter_mut()
                .zip(data.chunks_exact(block))
            {
                *sum = checksum::block_sum(bytemuck::cast_slice(block));
            }
        }
        Ok(())
    }

    fn restore_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()> {
        let len = self.backing(backing)?.data.len();
        self.check_copies(backing, len, copies)?;
        let (page, block, blocks) = (
            self.kv.snapshot_page_elems(),
            self.kv.page_elems(),
            self.page_blocks(),
        );
        let source = &self.backings[&backing];
        // Every block is checked before any is written: a refused restore leaves the pool's
        // pages as they were.
        let intact = copies.iter().all(|copy| {
            let at = copy.snapshot_page as usize * page;
            let first = copy.snapshot_page as usize * blocks;
            source.data[at..at + page]
                .chunks_exact(block)
                .zip(&source.sums[first..first + blocks])
                .all(|(data, &sum)| checksum::block_sum(bytemuck::cast_slice(data)) == sum)
        });
        if intact {
            for copy in copies {
                let at = copy.snapshot_page as usize * page;
                self.kv
                    .write_page(copy.pool_page, &source.data[at..at + page]);
            }
        }
        self.verdicts.push(intact);
        Ok(())
    }

    fn clone_pages(&mut self, clones: &[PageClone]) -> Result<()> {
        let pages = self.info.num_pages;
        if let Some(bad) = clones
            .iter()
            .find(|c| c.from.index() >= pages || c.to.index() >= pages || c.from == c.to)
        {
            return Err(EngineError::InvalidStep(format!(
                "page clone {bad:?} is out of range or onto itself ({pages} pages)"
            )));
        }
        for clone in clones {
            self.kv.clone_page(clone.from, clone.to);
        }
        Ok(())
    }

    fn copy_backing(&mut self, from: BackingId, to: BackingId) -> Result<()> {
        let source = std::mem::take(&mut self.backing(from)?.data);
        let result = match self.backing(to) {
            Ok(target) if target.data.len() == source.len() => {
                target.data.copy_from_slice(&source);
                Ok(())
            }
            Ok(target) => Err(EngineError::Backing(
                to.to_string(),
                format!(
                    "holds {} elements, the source {}",
                    target.data.len(),
                    source.len()
                ),
            )),
            Err(e) => Err(e),
        };
        self.backing(from).expect("taken from it above").data = source;
        if result.is_ok() {
            let sums = self.backings[&from].sums.clone();
            self.backing(to).expect("copied into above").sums = sums;
            self.copied.push(to);
        }
        result
    }

    fn finished_copies(&mut self, _wait: bool) -> Vec<(BackingId, Result<()>)> {
        self.copied.drain(..).map(|to| (to, Ok(()))).collect()
    }

    fn backing_ids(&self) -> Vec<BackingId> {
        self.backings.keys().copied().collect()
    }

    fn restore_verdicts(&mut self) -> Result<Vec<bool>> {
        Ok(std::mem::take(&mut self.verdicts))
    }

    fn backing_sums(&mut self, backing: BackingId) -> Result<Vec<u64>> {
        Ok(self.backing(backing)?.sums.clone())
    }

    fn set_backing_sums(&mut self, backing: BackingId, sums: &[u64]) -> Result<()> {
        let target = self.backing(backing)?;
        if target.sums.len() != sums.len() {
            return Err(EngineError::Backing(
                backing.to_string(),
                format!(
                    "has {} blocks, {} sums given",
                    target.sums.len(),
                    sums.len()
                ),
            ));
        }
        target.sums.copy_from_slice(sums);
        Ok(())
    }

    fn host_runs(&mut self, backing: BackingId) -> Result<Vec<HostRun>> {
        let data = &mut self.backing(backing)?.data;
        Ok(vec![HostRun {
            ptr: data.as_mut_ptr().cast(),
            len: data.len() * 4,
        }])
    }

    fn read_backing(&mut self, backing: BackingId) -> Result<Vec<u8>> {
        Ok(bytemuck::cast_slice(&self.backing(backing)?.data).to_vec())
    }

    fn flip_byte(&mut self, backing: BackingId, offset: u64, mask: u8) -> Result<()> {
        let data: &mut [u8] = bytemuck::cast_slice_mut(&mut self.backing(backing)?.data);
        let byte = usize::try_from(offset)
            .ok()
            .and_then(|at| data.get_mut(at))
            .ok_or_else(|| {
                EngineError::Backing(backing.to_string(), format!("no byte {offset}"))
            })?;
        *byte ^= mask;
        Ok(())
    }

    fn memory(&self) -> MemoryReport {
        let tier_bytes = |tier: Tier| {
            self.backings
                .values()
                .filter(|b| b.tier == tier)
                .map(|b| b.data.len() as u64 * 4)
                .sum()
        };
        MemoryReport {
            weights_bytes: self.weights.bytes(),
            pool_bytes: self.kv.bytes(),
            device_snapshot_bytes: tier_bytes(Tier::Device),
            host_snapshot_bytes: tier_bytes(Tier::Host),
            backings: self.backings.len(),
        }
    }
}

/// One step's forward pass, borrowing the backend's parts.
struct Forward<'a> {
    config: &'a ModelConfig,
    weights: &'a CpuWeights,
    kv: &'a mut KvPages,
    s: &'a mut Scratch,
    inv_freq: &'a [f32],
}

impl Forward<'_> {
    fn run(&mut self, plan: &StepPlan) -> StepOutput {
        let queries: Vec<QueryPos> = plan
            .rows
            .iter()
            .flat_map(|row| {
                (row.start_pos..row.end_pos()).map(|pos| QueryPos {
                    pages: &row.pages,
                    pos,
                })
            })
            .collect();
        self.embed(plan);
        self.rope_tables(&queries);
        for layer in 0..self.config.num_layers {
            self.attention_block(layer, &queries);
            self.mlp_block(layer);
        }
        self.logits(plan)
    }

    fn embed(&mut self, plan: &StepPlan) {
        let h = self.config.hidden_size;
        self.s.x.clear();
        for &token in plan.rows.iter().flat_map(|r| &r.tokens) {
            let t = token as usize;
            self.weights.embed.extend_row(t, h, &mut self.s.x);
        }
    }

    /// Cosines and sines of every query's rotary angles, `[tokens, head_dim/2]`.
    fn rope_tables(&mut self, queries: &[QueryPos]) {
        let half = self.inv_freq.len();
        resize(&mut self.s.cos, queries.len() * half);
        resize(&mut self.s.sin, queries.len() * half);
        for (t, q) in queries.iter().enumerate() {
            for (i, &freq) in self.inv_freq.iter().enumerate() {
                let angle = (q.pos as f32 * freq) as f64;
                self.s.cos[t * half + i] = angle.cos() as f32;
                self.s.sin[t * half + i] = angle.sin() as f32;
            }
        }
    }

    fn attention_block(&mut self, layer: usize, queries: &[QueryPos]) {
        let c = self.config;
        let w = &self.weights.layers[layer];
        let (tokens, h) = (queries.len(), c.hidden_size);
        let width = c.q_dim() + 2 * c.kv_dim();
        resize(&mut self.s.normed, tokens * h);
        kernels::rms_norm(&self.s.x, &w.attn_norm, c.rms_norm_eps, &mut self.s.normed);
        resize(&mut self.s.qkv, tokens * width);
        w.wqkv
            .matmul(&self.s.normed, tokens, h, width, &mut self.s.qkv);
        if let Some(bias) = &w.bqkv {
            self.s
                .qkv
                .chunks_exact_mut(width)
                .for_each(|row| kernels::add_assign(row, bias));
        }
        self.rotate_and_store(layer, queries);
        resize(&mut self.s.attn, tokens * c.q_dim());
        let shape = AttentionShape {
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window: c.sliding_window,
        };
        attention::attend(
            self.kv,
            layer,
            shape,
            queries,
            &self.s.qkv,
            width,
            &mut self.s.attn,
        );
        resize(&mut self.s.projected, tokens * h);
        w.wo.matmul(&self.s.attn, tokens, c.q_dim(), h, &mut self.s.projected);
        kernels::add_assign(&mut self.s.x, &self.s.projected);
    }

    /// Applies rotary embeddings to each token's q and k heads and stores its k and v.
    fn rotate_and_store(&mut self, layer: usize, queries: &[QueryPos]) {
        let c = self.config;
        let (d, half) = (c.head_dim, c.head_dim / 2);
        let width = c.q_dim() + 2 * c.kv_dim();
        for (t, (row, query)) in self.s.qkv.chunks_exact_mut(width).zip(queries).enumerate() {
            let (cos, sin) = (
                &self.s.cos[t * half..(t + 1) * half],
                &self.s.sin[t * half..(t + 1) * half],
            );
            let (qk, v) = row.split_at_mut(c.q_dim() + c.kv_dim());
            for head in qk.chunks_exact_mut(d) {
                kernels::rope_head(head, cos, sin);
            }
            self.kv
                .write(layer, query.pages, query.pos, &qk[c.q_dim()..], v);
        }
    }

    fn mlp_block(&mut self, layer: usize) {
        let c = self.config;
        let w = &self.weights.layers[layer];
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let tokens = self.s.x.len() / h;
        kernels::rms_norm(&self.s.x, &w.ffn_norm, c.rms_norm_eps, &mut self.s.normed);
        resize(&mut self.s.gate_up, tokens * 2 * f);
        w.w_gate_up
            .matmul(&self.s.normed, tokens, h, 2 * f, &mut self.s.gate_up);
        resize(&mut self.s.act, tokens * f);
        kernels::silu_mul(&self.s.gate_up, f, &mut self.s.act);
        w.w_down
            .matmul(&self.s.act, tokens, f, h, &mut self.s.projected);
        kernels::add_assign(&mut self.s.x, &self.s.projected);
    }

    /// Final norm and vocabulary projection of the rows the plan asks logits for.
    fn logits(&mut self, plan: &StepPlan) -> StepOutput {
        let (h, vocab) = (self.config.hidden_size, self.config.vocab_size);
        let mut picked = Vec::new();
        let mut row_ranges = Vec::with_capacity(plan.rows.len());
        let mut first_token = 0;
        for row in &plan.rows {
            let start = picked.len() / h;
            let wanted = match row.logits {
                LogitsWanted::None => 0..0,
                LogitsWanted::Last => row.tokens.len() - 1..row.tokens.len(),
                LogitsWanted::All => 0..row.tokens.len(),
            };
            for t in wanted {
                let at = (first_token + t) * h;
                picked.extend_from_slice(&self.s.x[at..at + h]);
            }
            row_ranges.push(start..picked.len() / h);
            first_token += row.tokens.len();
        }
        let rows = picked.len() / h;
        let mut normed = vec![0f32; picked.len()];
        kernels::rms_norm(
            &picked,
            &self.weights.norm,
            self.config.rms_norm_eps,
            &mut normed,
        );
        let mut logits = vec![0f32; rows * vocab];
        self.weights
            .lm_head()
            .matmul(&normed, rows, h, vocab, &mut logits);
        StepOutput {
            vocab_size: vocab,
            logits,
            row_ranges,
        }
    }
}

/// `MemAvailable` of `/proc/meminfo`, where there is one.
fn available_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
