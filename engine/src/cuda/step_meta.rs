//! A step's metadata: packed on the host into one blob, copied to the device in one transfer,
//! and spread by one kernel into the typed buffers every other launch reads.
//!
//! Those buffers sit at fixed addresses for the backend's life, which is what lets a captured
//! CUDA graph replay with new metadata. The blob's layout is the one `kernels/step_meta.cu`
//! documents. Rows may be padded to a graph's batch size: a padding row holds one token at
//! position 0 whose K and V go to the pool's spare page, which no sequence owns.

use std::sync::Arc;

use cache::PageId;

use super::device::{Device, DeviceBuffer, PinnedBuffer};
use super::kernels::{
    Kernels, MetaBuffers, NO_ROW, RowBuffers, SAMPLE_PARAM_WORDS, STEP_HEADER_WORDS,
};
use crate::backend::{LogitsWanted, StepPlan};
use crate::error::{EngineError, Result};

/// The most a step may hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetaCapacity {
    pub tokens: usize,
    pub rows: usize,
    /// Pages one row's table may name.
    pub table_stride: usize,
}

impl MetaCapacity {
    /// Prefill work items: at most one per token, plus one partial item per row.
    fn items(&self) -> usize {
        self.tokens + self.rows
    }

    fn blob_words(&self) -> usize {
        STEP_HEADER_WORDS
            + 4 * self.tokens
            + (5 + self.table_stride + SAMPLE_PARAM_WORDS) * self.rows
            + 2 * self.items()
    }

    fn typed_words(&self) -> usize {
        1 + 5 * self.tokens
            + (3 + self.table_stride + SAMPLE_PARAM_WORDS) * self.rows
            + 2 * self.items()
    }

    /// Device bytes the metadata takes.
    pub fn bytes(&self) -> usize {
        4 * (self.blob_words() + self.typed_words())
    }
}

/// Which tokens' logits a step computes, and in which logit row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitSelection {
    /// As each row asks ([`LogitsWanted`]), packed in plan order.
    Wanted,
    /// The last token of every row (padding rows too), logit row = row index: sampling, and
    /// decode graphs, whose launches are fixed.
    LastOfEachRow,
}

/// How a step was packed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLayout {
    pub tokens: usize,
    /// Rows, padding included.
    pub rows: usize,
    /// Prefill work items, those of the rows of one token (see
    /// [`PackRequest::decode_rows_apart`]) not counted.
    pub items: usize,
    /// With [`PackRequest::decode_rows_apart`]: the rows of one token, listed as items `(row,
    /// 0)` after the `items` prefill ones, for decode attention.
    pub decode_items: usize,
    pub logit_rows: usize,
}

/// What [`StepMeta::load`] packs besides the plan.
pub struct PackRequest<'a> {
    pub plan: &'a StepPlan,
    pub select: LogitSelection,
    /// Pad the plan with rows up to this many.
    pub pad_rows_to: usize,
    /// Query tokens per prefill work item; 0 for a step that needs none.
    pub item_tokens: usize,
    /// List a prefill step's rows of one token (decode rows of a step that also holds a prompt
    /// chunk) after its prefill items instead of among them, for decode attention.
    pub decode_rows_apart: bool,
    /// Sampling parameters of rows `0..`, `SAMPLE_PARAM_WORDS` words each.
    pub sample_params: &'a [u32],
    /// The slot of the host's picks buffer the step's sampling writes
    /// ([`super::kernels::Picks`]).
    pub picks_slot: usize,
}

pub struct StepMeta {
    /// Two, used in turn: a step may be launched ahead while the upload of the one before it
    /// still waits in the stream to read its own.
    staging: [PinnedBuffer; 2],
    next_staging: usize,
    blob: DeviceBuffer,
    _typed: DeviceBuffer,
    buffers: MetaBuffers,
    capacity: MetaCapacity,
    page_tokens: usize,
    spare_page: PageId,
    device: Arc<Device>,
}

impl StepMeta {
    pub fn new(
        device: &Arc<Device>,
        capacity: MetaCapacity,
        page_tokens: usize,
        spare_page: PageId,
    ) -> Result<Self> {
        let staging = [
            PinnedBuffer::alloc(device, capacity.blob_words() * 4, "step metadata")?,
            PinnedBuffer::alloc(device, capacity.blob_words() * 4, "step metadata")?,
        ];
        let blob = DeviceBuffer::alloc(device, capacity.blob_words() * 4, "step metadata")?;
        let typed = DeviceBuffer::alloc(device, capacity.typed_words() * 4, "step metadata")?;
        let mut next = typed.ptr::<u32>();
        let mut take = |words: usize| {
            let at = next;
            next = next.offset(words);
            at
        };
        let (t, r) = (capacity.tokens, capacity.rows);
        let buffers = MetaBuffers {
            token_ids: take(t),
            positions: take(t),
            slots: take(t),
            logit_rows: take(t),
            rows: RowBuffers {
                start_token: take(r),
                start_pos: take(r),
                len: take(r),
                page_table: take(r * capacity.table_stride),
                table_stride: capacity.table_stride,
                items: take(2 * capacity.items()),
            },
            sample_params: take(SAMPLE_PARAM_WORDS * r),
            // Picks: a row each, and a step has no more rows than tokens.
            fed_tokens: take(t),
            picks_slot: take(1),
        };
        Ok(StepMeta {
            staging,
            next_staging: 0,
            blob,
            _typed: typed,
            buffers,
            capacity,
            page_tokens,
            spare_page,
            device: device.clone(),
        })
    }

    pub fn buffers(&self) -> &MetaBuffers {
        &self.buffers
    }

    /// Checks that a plan fits the buffers (the backend's own limits, beyond the model's).
    pub fn check(&self, plan: &StepPlan, pad_rows_to: usize) -> Result<()> {
        let c = &self.capacity;
        let tokens = plan.total_tokens() + pad_rows_to.saturating_sub(plan.rows.len());
        let fail = |what: String| Err(EngineError::InvalidStep(what));
        if tokens > c.tokens {
            return fail(format!(
                "{tokens} tokens exceed the step capacity of {}",
                c.tokens
            ));
        }
        if plan.rows.len().max(pad_rows_to) > c.rows {
            return fail(format!(
                "{} rows exceed the step capacity of {}",
                plan.rows.len(),
                c.rows
            ));
        }
        let pt = self.page_tokens;
        if let Some(row) = plan
            .rows
            .iter()
            .find(|r| r.end_pos().div_ceil(pt) > c.table_stride)
        {
            return fail(format!(
                "a row reaches position {}, beyond the {} pages a row may hold",
                row.end_pos(),
                c.table_stride
            ));
        }
        Ok(())
    }

    /// Packs the step, copies it to the device and spreads it into the typed buffers.
    pub fn load(&mut self, kernels: &Kernels, request: &PackRequest) -> Result<StepLayout> {
        let layout = self.stage(request)?;
        self.unpack(kernels)?;
        Ok(layout)
    }

    /// Spreads the blob [`StepMeta::stage`] copied into the typed buffers: one launch, which a
    /// decode graph holds as its first node.
    pub fn unpack(&self, kernels: &Kernels) -> Result<()> {
        kernels.unpack_step(self.blob.ptr::<u32>(), &self.buffers)
    }

    /// Packs the step and queues its copy to the device: [`StepMeta::load`] without the
    /// unpacking. The staging blob packed into is free: each is reused every other step, and
    /// the backend waits between two for the step that used it (a step waits for its results,
    /// and a step launched ahead for the one it follows).
    pub fn stage(&mut self, request: &PackRequest) -> Result<StepLayout> {
        self.check(request.plan, request.pad_rows_to)?;
        let (page_tokens, spare) = (self.page_tokens, self.spare_page);
        let staging = &mut self.staging[self.next_staging];
        self.next_staging ^= 1;
        let words = staging.as_mut_slice::<u32>();
        let (layout, len) = Packer {
            words,
            len: 0,
            page_tokens,
            spare,
        }
        .pack(request);
        let blob = self.blob.ptr::<u32>();
        self.device
            .upload(&staging.as_mut_slice::<u32>()[..len], blob)?;
        Ok(layout)
    }
}

/// Writes the blob's words in order.
struct Packer<'a> {
    words: &'a mut [u32],
    len: usize,
    page_tokens: usize,
    spare: PageId,
}

/// One row as packed: real or padding.
struct PackedRow<'a> {
    tokens: &'a [u32],
    start_pos: usize,
    pages: &'a [PageId],
    logits: LogitsWanted,
}

impl Packer<'_> {
    fn push(&mut self, word: u32) {
        self.words[self.len] = word;
        self.len += 1;
    }

    fn pack(mut self, request: &PackRequest) -> (StepLayout, usize) {
        let pad_tokens = [0u32];
        let spare = [self.spare];
        let mut rows: Vec<PackedRow> = request
            .plan
            .rows
            .iter()
            .map(|r| PackedRow {
                tokens: &r.tokens,
                start_pos: r.start_pos,
                pages: &r.pages[..r.end_pos().div_ceil(self.page_tokens)],
                logits: r.logits,
            })
            .collect();
        while rows.len() < request.pad_rows_to {
            rows.push(PackedRow {
                tokens: &pad_tokens,
                start_pos: 0,
                pages: &spare,
                logits: LogitsWanted::None,
            });
        }
        let (items, decode_items) = items(&rows, request.item_tokens, request.decode_rows_apart);
        let tokens: usize = rows.iter().map(|r| r.tokens.len()).sum();
        let entries: usize = rows.iter().map(|r| r.pages.len()).sum();
        let sampled = request.sample_params.len() / SAMPLE_PARAM_WORDS;
        for word in [
            tokens,
            rows.len(),
            items.len(),
            entries,
            sampled,
            request.picks_slot,
        ] {
            self.push(word as u32);
        }
        while self.len < STEP_HEADER_WORDS {
            self.push(0);
        }
        let logit_rows = self.push_tokens(&rows, request.select);
        self.push_rows(&rows);
        for row in &rows {
            row.pages.iter().for_each(|p| self.push(p.0));
        }
        for (row, first) in &items {
            self.push(*row);
            self.push(*first);
        }
        request.sample_params.iter().for_each(|&w| self.push(w));
        let layout = StepLayout {
            tokens,
            rows: rows.len(),
            items: items.len() - decode_items,
            decode_items,
            logit_rows,
        };
        (layout, self.len)
    }

    /// Each token's id, position, slot and logit row; returns the number of logit rows.
    fn push_tokens(&mut self, rows: &[PackedRow], select: LogitSelection) -> usize {
        let mut logit_rows = 0;
        for (r, row) in rows.iter().enumerate() {
            for (j, &token) in row.tokens.iter().enumerate() {
                let pos = row.start_pos + j;
                let page = row.pages[pos / self.page_tokens].0 as usize;
                let last = j + 1 == row.tokens.len();
                let logit_row = match select {
                    LogitSelection::LastOfEachRow if last => r as u32,
                    LogitSelection::Wanted if wants_logits(row.logits, last) => {
                        logit_rows += 1;
                        logit_rows as u32 - 1
                    }
                    _ => NO_ROW,
                };
                self.push(token);
                self.push(pos as u32);
                self.push((page * self.page_tokens + pos % self.page_tokens) as u32);
                self.push(logit_row);
            }
        }
        match select {
            LogitSelection::LastOfEachRow => rows.len(),
            LogitSelection::Wanted => logit_rows,
        }
    }

    fn push_rows(&mut self, rows: &[PackedRow]) {
        let (mut first_token, mut first_entry) = (0, 0);
        for row in rows {
            for word in [
                first_token,
                row.start_pos,
                row.tokens.len(),
                first_entry,
                row.pages.len(),
            ] {
                self.push(word as u32);
            }
            first_token += row.tokens.len();
            first_entry += row.pages.len();
        }
    }
}

fn wants_logits(wanted: LogitsWanted, last_token: bool) -> bool {
    match wanted {
        LogitsWanted::None => false,
        LogitsWanted::Last => last_token,
        LogitsWanted::All => true,
    }
}

/// Prefill work items: (row, first token within the row) every `item_tokens` tokens, those that
/// attend the most positions first. With `decode_rows_apart`, the rows of one token come last,
/// as (row, 0) in row order, and their count is returned too.
fn items(
    rows: &[PackedRow],
    item_tokens: usize,
    decode_rows_apart: bool,
) -> (Vec<(u32, u32)>, usize) {
    if item_tokens == 0 {
        return (Vec::new(), 0);
    }
    let apart = |row: &PackedRow| decode_rows_apart && row.tokens.len() == 1;
    let mut items: Vec<(u32, u32)> = rows
        .iter()
        .enumerate()
        .filter(|(_, row)| !apart(row))
        .flat_map(|(r, row)| {
            (0..row.tokens.len())
                .step_by(item_tokens)
                .map(move |first| (r as u32, first as u32))
        })
        .collect();
    // The items with the most keys start first and the short ones fill the last wave: a causal
    // prompt's last item reads every key of the prompt, its first one a tile.
    items.sort_by_key(|&(r, first)| std::cmp::Reverse(rows[r as usize].start_pos + first as usize));
    let before = items.len();
    items.extend(
        rows.iter()
            .enumerate()
            .filter(|(_, row)| apart(row))
            .map(|(r, _)| (r as u32, 0)),
    );
    let decode = items.len() - before;
    (items, decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tokens: &[u32], start_pos: usize) -> PackedRow<'_> {
        PackedRow {
            tokens,
            start_pos,
            pages: &[],
            logits: LogitsWanted::None,
        }
    }

    #[test]
    fn prefill_items_start_with_those_attending_the_most_positions() {
        let (fresh, continued) = ([0u32; 40], [0u32; 20]);
        // A fresh 40-token prompt in items of 16, and 20 tokens after 100 restored.
        let rows = [row(&fresh, 0), row(&continued, 100)];
        assert_eq!(
            items(&rows, 16, false).0,
            [(1, 16), (1, 0), (0, 32), (0, 16), (0, 0)]
        );
        // Ties keep the rows' order.
        let rows = [row(&fresh[..5], 7), row(&fresh[..3], 7)];
        assert_eq!(items(&rows, 16, false).0, [(0, 0), (1, 0)]);
        assert!(items(&rows, 0, false).0.is_empty());
    }

    #[test]
    fn decode_rows_of_a_prefill_step_are_listed_after_its_items() {
        let (prompt, one) = ([0u32; 40], [0u32; 1]);
        let rows = [
            row(&one, 500),
            row(&prompt, 0),
            row(&one, 7),
            row(&one, 900),
        ];
        // Apart: the prompt's items, longest first, then the rows of one token in row order.
        assert_eq!(
            items(&rows, 16, true),
            (vec![(1, 32), (1, 16), (1, 0), (0, 0), (2, 0), (3, 0)], 3)
        );
        // Among the items otherwise, by the positions they attend.
        assert_eq!(
            items(&rows, 16, false),
            (vec![(3, 0), (0, 0), (1, 32), (1, 16), (2, 0), (1, 0)], 0)
        );
    }
}
