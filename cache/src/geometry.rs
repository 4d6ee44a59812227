//! The shape of the KV cache, shared by the pool's bookkeeping and the engine's bytes.
//!
//! A page holds `page_tokens` consecutive token positions of one sequence, for every layer's K
//! and V. Byte sizes derive from the geometry alone, so the store can charge a snapshot before
//! anything is allocated.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_geometry_sizes() {
        let g = KvGeometry {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            page_tokens: 16,
            dtype_bytes: 2,
        };
        assert_eq!(g.token_bytes(), 2 * 30 * 3 * 64 * 2);
        assert_eq!(g.page_bytes(), 16 * 23_040);
        assert_eq!(g.pages_for(0), 0);
        assert_eq!(g.pages_for(16), 1);
        assert_eq!(g.pages_for(17), 2);
    }
}
