//! Chained hashes of full pages of token ids: the key under which snapshots are found.
//!
//! Owns the hash function, the salt and the chain. Page `i`'s hash covers the salt and every
//! token of pages `0..=i`, so equal prefixes under equal salts give equal chains, one hash names
//! its whole prefix, and the store can match a query page by page. A trailing partial page is
//! never hashed: snapshots are page-aligned. This module never looks anything up.
//!
//! The function is SHA-256 of (parent hash, the page's tokens as little-endian `u32`), truncated
//! to 128 bits. Not FNV or xxHash: prompts are user input, and with a non-cryptographic hash a
//! tenant can build a page that collides with another tenant's prefix and be served that
//! tenant's KV (vLLM GHSA-rm76-4mrf-v9r8; vLLM made SHA-256 its default in v0.10.2). A hit is
//! taken on the hash alone, so it must be as good as comparing the tokens: at 128 bits a second
//! preimage costs 2^128 work and any collision at all 2^64, far beyond what a server ever
//! hashes (64 bits would leave an accidental collision at 2^32 pages within reach of a fleet's
//! lifetime). Hashing is done once per request, when it is admitted, at about 155 ns a 16-token
//! page with the CPU's SHA instructions (2-vCPU dev VM: 2,000 pages in 310-325 µs; ~385 µs
//! when each token was an update of its own); lookups only compare the 128-bit values. The
//! salt's fields are tagged and length-prefixed so that a model name can
//! never be mistaken for an adapter name. [`PrefixHasher::whole`] keys a whole sequence, its
//! partial page included, for what is kept per prompt rather than per page (its logits).

use sha2::{Digest, Sha256};

/// The hash of one page-aligned prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PrefixHash(pub u128);

/// What makes the same tokens mean different KV: the model and the adapter. It seeds every
/// chain, so snapshots of one model are never found for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefixSalt(pub u128);

const DOMAIN: &[u8] = b"snapserve prefix chain v2";

impl PrefixSalt {
    /// The salt for `model` (a name or content digest) with an optional adapter.
    pub fn new(model: &str, adapter: Option<&str>) -> PrefixSalt {
        let mut hasher = Sha256::new();
        hasher.update(DOMAIN);
        absorb_field(&mut hasher, b'm', model.as_bytes());
        if let Some(adapter) = adapter {
            absorb_field(&mut hasher, b'a', adapter.as_bytes());
        }
        PrefixSalt(truncate(hasher))
    }
}

fn absorb_field(hasher: &mut Sha256, tag: u8, bytes: &[u8]) {
    hasher.update([tag]);
    hasher.update((bytes.len() as u64).to_le_bytes());
    hasher.update(bytes);
}

fn truncate(hasher: Sha256) -> u128 {
    let digest = hasher.finalize();
    let mut head = [0u8; 16];
    head.copy_from_slice(&digest[..16]);
    u128::from_le_bytes(head)
}

/// Hashes token sequences into chains, one hash per full page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHasher {
    salt: PrefixSalt,
    page_tokens: usize,
}

impl PrefixHasher {
    pub fn new(salt: PrefixSalt, page_tokens: usize) -> PrefixHasher {
        assert!(page_tokens > 0, "a page holds at least one token");
        PrefixHasher { salt, page_tokens }
    }

    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }

    /// The chain of every full page of `tokens`.
    pub fn chain(&self, tokens: &[u32]) -> Vec<PrefixHash> {
        let mut chain = Vec::with_capacity(tokens.len() / self.page_tokens);
        self.extend(&mut chain, tokens);
        chain
    }

    /// Appends to `chain` (the chain of a prefix of `tokens`) the hashes of the full pages of
    /// `tokens` it does not cover yet, so a growing sequence is hashed once per page.
    pub fn extend(&self, chain: &mut Vec<PrefixHash>, tokens: &[u32]) {
        let mut parent = chain.last().map_or(self.salt.0, |hash| hash.0);
        let done = chain.len() * self.page_tokens;
        for page in tokens
            .get(done..)
            .unwrap_or_default()
            .chunks_exact(self.page_tokens)
        {
            parent = page_hash(parent, page);
            chain.push(PrefixHash(parent));
        }
    }
}

impl PrefixHasher {
    /// The key of a whole sequence, its trailing partial page included: `chain` is the chain
    /// of its full pages ([`PrefixHasher::chain`]). No page hash equals it: a tag and the
    /// sequence's length go in before the tail, so a page-aligned sequence's key differs from
    /// its last page's hash, and a tail can never be mistaken for a page.
    pub fn whole(&self, chain: &[PrefixHash], tokens: &[u32]) -> PrefixHash {
        let full = chain.len() * self.page_tokens;
        assert!(
            tokens.len() >= full && tokens.len() - full < self.page_tokens,
            "the chain covers every full page of the sequence"
        );
        let parent = chain.last().map_or(self.salt.0, |hash| hash.0);
        let mut hasher = Sha256::new();
        hasher.update(WHOLE_TAG);
        hasher.update(parent.to_le_bytes());
        hasher.update((tokens.len() as u64).to_le_bytes());
        tokens[full..]
            .iter()
            .for_each(|t| hasher.update(t.to_le_bytes()));
        PrefixHash(truncate(hasher))
    }
}

const WHOLE_TAG: &[u8] = b"snapserve whole sequence v1";

fn page_hash(parent: u128, page: &[u32]) -> u128 {
    const CHUNK: usize = 64;
    let mut hasher = Sha256::new();
    hasher.update(parent.to_le_bytes());
    // The tokens go in as a few long updates, the same bytes as one update a token: with the
    // CPU's SHA instructions a 4-byte update's bookkeeping cost more than the compression.
    let mut bytes = [0u8; 4 * CHUNK];
    for tokens in page.chunks(CHUNK) {
        for (out, token) in bytes.chunks_exact_mut(4).zip(tokens) {
            out.copy_from_slice(&token.to_le_bytes());
        }
        hasher.update(&bytes[..4 * tokens.len()]);
    }
    truncate(hasher)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher() -> PrefixHasher {
        PrefixHasher::new(PrefixSalt::new("smollm2-135m", None), 4)
    }

    #[test]
    fn one_hash_per_full_page_and_none_for_the_tail() {
        let h = hasher();
        assert_eq!(h.chain(&[1, 2, 3]).len(), 0);
        assert_eq!(h.chain(&[1, 2, 3, 4]).len(), 1);
        assert_eq!(h.chain(&[1, 2, 3, 4, 5, 6, 7, 8, 9]).len(), 2);
    }

    #[test]
    fn equal_prefixes_give_equal_chains_and_a_difference_propagates() {
        let h = hasher();
        let a = h.chain(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let b = h.chain(&[1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 7]);
        let c = h.chain(&[9, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1], "page 1 is equal but its parent differs");
    }

    #[test]
    fn the_salt_separates_models_and_adapters() {
        let tokens = [1, 2, 3, 4];
        let chain =
            |model, adapter| PrefixHasher::new(PrefixSalt::new(model, adapter), 4).chain(&tokens);
        assert_ne!(chain("a", None), chain("b", None));
        assert_ne!(chain("a", None), chain("a", Some("lora")));
        assert_ne!(chain("ab", None), chain("a", Some("b")));
        assert_eq!(chain("a", Some("lora")), chain("a", Some("lora")));
    }

    #[test]
    fn extending_a_chain_equals_hashing_the_whole_sequence() {
        let h = hasher();
        let tokens: Vec<u32> = (0..23).collect();
        let mut chain = h.chain(&tokens[..6]);
        h.extend(&mut chain, &tokens[..13]);
        h.extend(&mut chain, &tokens);
        assert_eq!(chain, h.chain(&tokens));
    }

    #[test]
    fn a_whole_sequence_s_key_covers_its_tail_and_no_page_shares_it() {
        let h = hasher();
        let key = |tokens: &[u32]| h.whole(&h.chain(tokens), tokens);
        let aligned = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_ne!(key(&aligned), h.chain(&aligned)[1]);
        assert_ne!(key(&aligned[..4]), h.chain(&aligned)[0]);
        assert_eq!(key(&[1, 2, 3, 4, 5]), key(&[1, 2, 3, 4, 5]));
        assert_ne!(key(&[1, 2, 3, 4, 5]), key(&[1, 2, 3, 4, 6]));
        assert_ne!(
            key(&[1, 2, 3, 4, 5]),
            key(&[9, 2, 3, 4, 5]),
            "the pages count"
        );
        assert_ne!(
            key(&[1, 2, 3, 4, 0]),
            key(&[1, 2, 3, 4]),
            "so does the length"
        );
        assert_ne!(key(&[1]), key(&[]));
        let other = PrefixHasher::new(PrefixSalt::new("other", None), 4);
        assert_ne!(key(&[1, 2]), other.whole(&[], &[1, 2]));
    }

    #[test]
    fn the_chain_is_stable_across_builds() {
        // Chains travel in frames to disk and to peers, so the function must never drift.
        let h = PrefixHasher::new(PrefixSalt::new("m", None), 2);
        assert_eq!(h.chain(&[1, 2]), vec![PrefixHash(STABLE_FIRST_PAGE)]);
        // Pages longer than the function's buffer hash their tokens' bytes all the same.
        let tokens: Vec<u32> = (0..300u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let salt = PrefixSalt::new("m", None);
        for page_tokens in [16, 64, 150] {
            let chain = PrefixHasher::new(salt, page_tokens).chain(&tokens);
            let mut parent = salt.0;
            for (page, hash) in tokens.chunks_exact(page_tokens).zip(&chain) {
                let mut hasher = Sha256::new();
                hasher.update(parent.to_le_bytes());
                page.iter().for_each(|t| hasher.update(t.to_le_bytes()));
                parent = truncate(hasher);
                assert_eq!(hash.0, parent, "{page_tokens}-token pages");
            }
        }
    }

    /// From Python's hashlib, independently of this code: the salt is SHA-256 of the domain,
    /// `b"m"`, the name's length as a little-endian u64 and `b"m"`, cut to 16 bytes; the page
    /// hash is SHA-256 of those 16 bytes and tokens 1 and 2 as little-endian u32, cut alike.
    const STABLE_FIRST_PAGE: u128 = 154_561_118_366_127_818_232_513_244_673_848_029_572;
}
