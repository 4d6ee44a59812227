//! Tensor parallelism's split of one model over `world` ranks (Megatron-style).
//!
//! Rank `r` holds query heads `r·H/N..(r+1)·H/N` and the KV heads they read, so attention needs
//! no exchange; the output projection's columns for those heads, so each rank's output is a
//! partial sum over heads; the MLP's gate and up rows `r·F/N..`, and the down projection's
//! matching columns, again a partial sum. One all-reduce after each sublayer adds the partial
//! sums into every rank's residual stream. The vocabulary is split by rows (`r·V/N..`), the
//! embedding table and the vocabulary projection alike (a tied model's projection is its rank's
//! rows of the table): each rank gathers the embedding rows of the tokens it holds (zeros for
//! the others) and one more all-reduce puts every token's row together, and each rank computes
//! its slice of the logits, gathered on rank 0 for sampling. (A Llama-3 vocabulary's table is
//! 1 GB at hidden 4,096 and 2 GB at 8,192: held whole, every rank would pay for all of it.)
//!
//! With `world = 1` the shard is the whole model and nothing is exchanged.

use std::ops::Range;

use super::ModelConfig;
use crate::error::{EngineError, Result};

/// One rank's place in a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// The whole model on one device.
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// Every rank of a group of `world`, after checking that `config` splits that way.
    pub fn group(config: &ModelConfig, world: usize) -> Result<Vec<Shard>> {
        check_divides(config, world)?;
        Ok((0..world).map(|rank| Shard { rank, world }).collect())
    }

    pub fn is_whole(&self) -> bool {
        self.world == 1
    }

    /// The model as this rank computes it: its heads, KV heads and MLP columns. The vocabulary
    /// stays whole here; [`Shard::vocab`] is the slice of it this rank holds.
    pub fn local(&self, config: &ModelConfig) -> ModelConfig {
        let n = self.world;
        ModelConfig {
            num_heads: config.num_heads / n,
            num_kv_heads: config.num_kv_heads / n,
            intermediate_size: config.intermediate_size / n,
            ..config.clone()
        }
    }

    /// This rank's `n`-th of `0..total`.
    fn part(&self, total: usize) -> Range<usize> {
        let each = total / self.world;
        self.rank * each..(self.rank + 1) * each
    }

    /// Query heads this rank computes.
    pub fn heads(&self, config: &ModelConfig) -> Range<usize> {
        self.part(config.num_heads)
    }

    /// KV heads this rank holds.
    pub fn kv_heads(&self, config: &ModelConfig) -> Range<usize> {
        self.part(config.num_kv_heads)
    }

    /// Rows of the gate (and of the up) projection, columns of the down projection.
    pub fn mlp(&self, config: &ModelConfig) -> Range<usize> {
        self.part(config.intermediate_size)
    }

    /// Vocabulary rows this rank's logits cover.
    pub fn vocab(&self, config: &ModelConfig) -> Range<usize> {
        self.part(config.vocab_size)
    }
}

/// Whether `config` splits over `world` ranks: heads, KV heads, the MLP's width and the
/// vocabulary must each divide evenly.
pub fn check_divides(config: &ModelConfig, world: usize) -> Result<()> {
    if world == 0 {
        return Err(EngineError::TensorParallel(
            "tensor_parallel must be at least 1".into(),
        ));
    }
    let parts = [
        ("num_attention_heads", config.num_heads),
        ("num_key_value_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
    ];
    let uneven: Vec<String> = parts
        .iter()
        .filter(|(_, n)| n % world != 0)
        .map(|(name, n)| format!("{name} = {n}"))
        .collect();
    if uneven.is_empty() {
        return Ok(());
    }
    Err(EngineError::TensorParallel(format!(
        "tensor_parallel = {world} does not divide the model: {} (each must be a multiple of \
         {world})",
        uneven.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(
        heads: usize,
        kv_heads: usize,
        hidden: usize,
        mlp: usize,
        vocab: usize,
    ) -> ModelConfig {
        let json = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": {hidden},
                "intermediate_size": {mlp}, "num_hidden_layers": 2,
                "num_attention_heads": {heads}, "num_key_value_heads": {kv_heads},
                "vocab_size": {vocab}, "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0}}"#
        );
        ModelConfig::from_json(&json, std::path::Path::new("config.json")).unwrap()
    }

    fn llama_like() -> ModelConfig {
        config(32, 8, 4096, 14336, 128256)
    }

    #[test]
    fn ranks_cover_every_head_column_and_word_once() {
        let config = llama_like();
        for world in [1, 2, 4, 8] {
            let group = Shard::group(&config, world).unwrap();
            assert_eq!(group.len(), world);
            for (pick, total) in [
                (Shard::heads as fn(&Shard, &ModelConfig) -> Range<usize>, 32),
                (Shard::kv_heads, 8),
                (Shard::mlp, 14336),
                (Shard::vocab, 128256),
            ] {
                let mut next = 0;
                for shard in &group {
                    let range = pick(shard, &config);
                    assert_eq!(
                        range.start, next,
                        "world {world}: contiguous, in rank order"
                    );
                    next = range.end;
                }
                assert_eq!(next, total, "world {world}: everything covered");
            }
        }
    }

    #[test]
    fn a_rank_computes_its_heads_with_their_groups_intact() {
        let config = llama_like();
        let local = Shard { rank: 1, world: 4 }.local(&config);
        assert_eq!((local.num_heads, local.num_kv_heads), (8, 2));
        assert_eq!(local.group_size(), config.group_size());
        assert_eq!(local.intermediate_size, 14336 / 4);
        assert_eq!(local.q_dim(), 8 * 128);
        assert_eq!((local.hidden_size, local.vocab_size), (4096, 128256));
        assert_eq!(Shard::WHOLE.local(&config), config);
    }

    #[test]
    fn an_uneven_split_names_what_does_not_divide() {
        // SmolLM2-135M: 9 heads, 3 KV heads, MLP 1536, vocabulary 49,152.
        let config = config(9, 3, 576, 1536, 49152);
        let err = Shard::group(&config, 2).unwrap_err().to_string();
        assert!(err.contains("num_attention_heads = 9"), "{err}");
        assert!(err.contains("num_key_value_heads = 3"), "{err}");
        assert!(!err.contains("intermediate_size"), "{err}");
        assert!(Shard::group(&config, 3).is_ok());
        assert!(Shard::group(&config, 0).is_err());
    }
}
