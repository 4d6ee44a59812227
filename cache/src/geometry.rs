//! The shape of the KV cache, shared by the pool's bookkeeping and the engine's bytes.
//!
//! A page holds `page_tokens` consecutive token positions of one sequence, for every layer's K
//! and V. Byte sizes derive from the geometry alone, so the store can charge a snapshot before
//! anything is allocated. Nothing here owns memory.

/// Index of one page of the working pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(pub u32);

impl PageId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Dimensions of the KV cache of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub page_tokens: usize,
    /// Bytes of one stored K or V element (4 for f32, 2 for bf16).
    pub dtype_bytes: usize,
}

impl KvGeometry {
    /// Elements of K (or of V) for one token in one layer.
    pub fn token_elems_per_layer(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of K and V for one token across all layers.
    pub fn token_bytes(&self) -> usize {
        2 * self.layers * self.token_elems_per_layer() * self.dtype_bytes
    }

    /// Bytes of K and V for one page across all layers.
    pub fn page_bytes(&self) -> usize {
        self.page_tokens * self.token_bytes()
    }

    /// Pages needed to hold `tokens` positions.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }
}

/// What one snapshot holds: the KV of a page-aligned prefix plus the fixed per-sequence state a
/// model keeps beside its KV (a sliding window's ring, say; zero for plain Llama).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotGeometry {
    pub kv: KvGeometry,
    pub fixed_state_bytes: u64,
}

impl SnapshotGeometry {
    /// Bytes of a snapshot of `pages` full pages, or `None` if that overflows a `u64` (only a
    /// corrupt frame can ask for that).
    pub fn checked_bytes_for_pages(&self, pages: u64) -> Option<u64> {
        let token_bytes = 2u64
            .checked_mul(self.kv.layers as u64)?
            .checked_mul(self.kv.kv_heads as u64)?
            .checked_mul(self.kv.head_dim as u64)?
            .checked_mul(self.kv.dtype_bytes as u64)?;
        pages
            .checked_mul(self.kv.page_tokens as u64)?
            .checked_mul(token_bytes)?
            .checked_add(self.fixed_state_bytes)
    }

    /// Bytes of a snapshot of `pages` full pages.
    pub fn bytes_for_pages(&self, pages: usize) -> u64 {
        self.checked_bytes_for_pages(pages as u64)
            .expect("a snapshot of a prefix that fits in memory has a byte size that fits in u64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> KvGeometry {
        KvGeometry {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            page_tokens: 16,
            dtype_bytes: 2,
        }
    }

    #[test]
    fn smollm2_geometry_sizes() {
        let g = smollm2();
        assert_eq!(g.token_bytes(), 2 * 30 * 3 * 64 * 2);
        assert_eq!(g.page_bytes(), 16 * 23_040);
        assert_eq!(g.pages_for(0), 0);
        assert_eq!(g.pages_for(16), 1);
        assert_eq!(g.pages_for(17), 2);
    }

    #[test]
    fn snapshot_bytes_are_layers_heads_dim_dtype_tokens_plus_fixed_state() {
        let g = SnapshotGeometry {
            kv: smollm2(),
            fixed_state_bytes: 1_000,
        };
        assert_eq!(g.bytes_for_pages(0), 1_000);
        assert_eq!(g.bytes_for_pages(3), 3 * 16 * 23_040 + 1_000);
        assert_eq!(g.checked_bytes_for_pages(u64::MAX / 2), None);
    }
}
