//! The CPU backend's KV pages and paged causal attention.
//!
//! Each layer keeps K and V as `[page][token in page][kv head][head dim]` f32 arrays. A query at
//! position `p` attends to positions `lo..=p` of its own sequence (`lo > 0` only under a sliding
//! window), found through the sequence's page table. One task handles one token and one KV
//! head: the query heads sharing that KV head (grouped-query attention) read each K and V row
//! once. Scores use [`matmul::dots`], softmax is exact (two passes over the scores), and V rows
//! are accumulated in position order, so a query's output depends only on its own sequence:
//! batching and chunking never change it.

use std::cell::RefCell;

use cache::{KvGeometry, PageId};
use multiversion::multiversion;
use rayon::prelude::*;

use super::kernels::exp_body;
use super::matmul::{self, Isa};

/// The working pool's K and V bytes for every layer.
pub struct KvPages {
    geometry: KvGeometry,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvPages {
    pub fn new(geometry: KvGeometry, num_pages: usize) -> Self {
        let per_layer = num_pages * geometry.page_tokens * geometry.token_elems_per_layer();
        Self {
            geometry,
            k: vec![vec![0f32; per_layer]; geometry.layers],
            v: vec![vec![0f32; per_layer]; geometry.layers],
        }
    }

    /// Element offset of position `pos` of the sequence whose page table is `pages`.
    fn offset(&self, pages: &[PageId], pos: usize) -> usize {
        let pt = self.geometry.page_tokens;
        (pages[pos / pt].index() * pt + pos % pt) * self.geometry.token_elems_per_layer()
    }

    /// Elements of one page of one layer's K (or V).
    pub fn page_elems(&self) -> usize {
        self.geometry.page_tokens * self.geometry.token_elems_per_layer()
    }

    /// Elements of one page across all layers, K and V: one snapshot page.
    pub fn snapshot_page_elems(&self) -> usize {
        2 * self.geometry.layers * self.page_elems()
    }

    /// Copies `page` into `out` (one snapshot page: each layer's K block, then its V block).
    pub fn read_page(&self, page: PageId, out: &mut [f32]) {
        let n = self.page_elems();
        let at = page.index() * n;
        for (layer, blocks) in out.chunks_exact_mut(2 * n).enumerate() {
            let (k, v) = blocks.split_at_mut(n);
            k.copy_from_slice(&self.k[layer][at..at + n]);
            v.copy_from_slice(&self.v[layer][at..at + n]);
        }
    }

    /// Overwrites `page` with one snapshot page, the inverse of [`KvPages::read_page`].
    pub fn write_page(&mut self, page: PageId, data: &[f32]) {
        let n = self.page_elems();
        let at = page.index() * n;
        for (layer, blocks) in data.chunks_exact(2 * n).enumerate() {
            let (k, v) = blocks.split_at(n);
            self.k[layer][at..at + n].copy_from_slice(k);
            self.v[layer][at..at + n].copy_from_slice(v);
        }
    }

    /// Copies page `from` into page `to`, every layer's K and V.
    pub fn clone_page(&mut self, from: PageId, to: PageId) {
        let n = self.page_elems();
        let (src, dst) = (from.index() * n, to.index() * n);
        for block in self.k.iter_mut().chain(self.v.iter_mut()) {
            block.copy_within(src..src + n, dst);
        }
    }

    pub fn bytes(&self) -> u64 {
        (self.k.iter().chain(&self.v).map(Vec::len).sum::<usize>() * 4) as u64
    }

    /// Stores one token's K and V (`kv_heads × head_dim` each) for `layer`.
    pub fn write(&mut self, layer: usize, pages: &[PageId], pos: usize, k: &[f32], v: &[f32]) {
        let at = self.offset(pages, pos);
        let n = k.len();
        self.k[layer][at..at + n].copy_from_slice(k);
        self.v[layer][at..at + n].copy_from_slice(v);
    }
}

/// Where one query token sits: its sequence's page table and its position.
#[derive(Debug, Clone, Copy)]
pub struct QueryPos<'a> {
    pub pages: &'a [PageId],
    pub pos: usize,
}

/// The shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
}

thread_local! {
    /// Scores of the task running on this thread, `[query head][position]`.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out[t, h] = softmax(q[t, h] · Kᵀ / √d) · V` over each query's visible positions.
///
/// `q` holds each token's query heads at the start of a `q_stride`-wide row; `out` is
/// `[tokens, heads × head_dim]`. All of this step's K and V must already be in `kv`.
pub fn attend(
    kv: &KvPages,
    layer: usize,
    shape: AttentionShape,
    queries: &[QueryPos],
    q: &[f32],
    q_stride: usize,
    out: &mut [f32],
) {
    let group = shape.heads / shape.kv_heads;
    let width = group * shape.head_dim;
    let isa = Isa::detect();
    out.par_chunks_mut(width)
        .enumerate()
        .for_each(|(unit, out)| {
            let (t, g) = (unit / shape.kv_heads, unit % shape.kv_heads);
            let q = &q[t * q_stride + g * width..][..width];
            let task = GroupTask {
                kv,
                layer,
                shape,
                kv_head: g,
                query: queries[t],
            };
            SCORES.with_borrow_mut(|scores| task.run(isa, q, scores, out));
        });
}

/// One token's query heads that share KV head `kv_head`.
struct GroupTask<'a> {
    kv: &'a KvPages,
    layer: usize,
    shape: AttentionShape,
    kv_head: usize,
    query: QueryPos<'a>,
}

impl GroupTask<'_> {
    fn run(&self, isa: Isa, q: &[f32], scores: &mut Vec<f32>, out: &mut [f32]) {
        let d = self.shape.head_dim;
        let lo = self
            .shape
            .window
            .map_or(0, |w| (self.query.pos + 1).saturating_sub(w));
        let visible = self.query.pos + 1 - lo;
        scores.clear();
        scores.resize(q.len() / d * visible, 0.0);
        self.scores(isa, q, lo, visible, scores);
        let rows: Vec<usize> = (lo..=self.query.pos)
            .map(|p| self.kv.offset(self.query.pages, p) + self.kv_head * d)
            .collect();
        softmax_pv(
            &self.kv.v[self.layer],
            &rows,
            scores,
            1.0 / (d as f32).sqrt(),
            out,
        );
    }

    /// Raw scores `q_h · k_p` into `scores[h * visible + (p - lo)]`, a page at a time.
    fn scores(&self, isa: Isa, q: &[f32], lo: usize, visible: usize, scores: &mut [f32]) {
        let (d, pt) = (self.shape.head_dim, self.kv.geometry.page_tokens);
        let row = self.kv.geometry.token_elems_per_layer();
        let k = &self.kv.k[self.layer];
        let mut p = lo;
        while p <= self.query.pos {
            let count = (pt - p % pt).min(self.query.pos + 1 - p);
            let at = self.kv.offset(self.query.pages, p) + self.kv_head * d;
            matmul::dots(
                isa,
                q,
                d,
                q.len() / d,
                &k[at..],
                row,
                count,
                d,
                &mut scores[p - lo..],
                visible,
            );
            p += count;
        }
    }
}

/// Scales and softmaxes each head's scores, then accumulates V rows (at `rows`) in order.
#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn softmax_pv(v: &[f32], rows: &[usize], scores: &mut [f32], scale: f32, out: &mut [f32]) {
    let visible = rows.len();
    let d = out.len() / (scores.len() / visible);
    for head in scores.chunks_exact_mut(visible) {
        let max = head
            .iter()
            .fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
        // The exponentials in a loop of their own, which vectorizes; the sum in position
        // order after it (a float sum in a vector loop would be reordered).
        for s in head.iter_mut() {
            *s = exp_body(*s * scale - max);
        }
        let sum = head.iter().fold(0f32, |sum, &s| sum + s);
        let inv = 1.0 / sum;
        head.iter_mut().for_each(|s| *s *= inv);
    }
    // A head at a time, its output row held in registers where the head is 64 or 128 wide:
    // each element still sums its V column in position order, from zero.
    for (head, out) in scores.chunks_exact(visible).zip(out.chunks_exact_mut(d)) {
        match d {
            64 => weighted_rows::<64>(v, rows, head, out),
            128 => weighted_rows::<128>(v, rows, head, out),
            _ => {
                out.fill(0.0);
                for (&w, &at) in head.iter().zip(rows) {
                    for (o, &x) in out.iter_mut().zip(&v[at..at + d]) {
                        *o = w.mul_add(x, *o);
                    }
                }
            }
        }
    }
}

/// `out = Σ_j weights[j] · v[rows[j]..][..D]`, each element summed in order from zero, in a
/// local array the compiler keeps in registers (inlined into `softmax_pv`'s versions).
#[inline(always)]
fn weighted_rows<const D: usize>(v: &[f32], rows: &[usize], weights: &[f32], out: &mut [f32]) {
    let mut acc = [0f32; D];
    for (&w, &at) in weights.iter().zip(rows) {
        let v_row: &[f32; D] = v[at..at + D].try_into().expect("a whole V row");
        for (a, &x) in acc.iter_mut().zip(v_row) {
            *a = w.mul_add(x, *a);
        }
    }
    out.copy_from_slice(&acc);
}
