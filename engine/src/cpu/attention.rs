//! The CPU backend's KV pages and paged causal attention.
//!
//! Each layer keeps K and V as `[page][token in page][kv head][head dim]` f32 arrays. A query at
//! position `p` attends to positions `lo..=p` of its own sequence (`lo > 0` only under a sliding
//! window), found through the sequence's page table; grouped-query heads share their KV head.

use cache::{KvGeometry, PageId};
use multiversion::multiversion;
use rayon::prelude::*;

use super::kernels::{axpy_body, dot_body};

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
    let d = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    out.par_chunks_mut(d).enumerate().for_each(|(i, out_head)| {
        let (t, h) = (i / shape.heads, i % shape.heads);
        let query = queries[t];
        let q_head = &q[t * q_stride + h * d..][..d];
        let lo = shape
            .window
            .map_or(0, |w| (query.pos + 1).saturating_sub(w));
        let rows: Vec<usize> = (lo..=query.pos)
            .map(|p| kv.offset(query.pages, p) + (h / group) * d)
            .collect();
        attend_head(&kv.k[layer], &kv.v[layer], &rows, q_head, scale, out_head);
    });
}

#[multiversion(targets("x86_64+avx512f", "x86_64+avx2+fma"))]
fn attend_head(k: &[f32], v: &[f32], rows: &[usize], q: &[f32], scale: f32, out: &mut [f32]) {
    let d = q.len();
    let mut scores: Vec<f32> = rows
        .iter()
        .map(|&at| dot_body(q, &k[at..at + d]) * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in &mut scores {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (&at, s) in rows.iter().zip(&scores) {
        axpy_body(out, s / sum, &v[at..at + d]);
    }
}
