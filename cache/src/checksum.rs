//! Checksums of snapshot bytes: one sum per block, the unit every copy moves.
//!
//! A snapshot page is, for each layer in order, that page's K block then its V block; a block
//! is `page_tokens × kv_heads × head_dim` elements. Each copy that fills a snapshot (a save, a
//! demotion, a read from disk) computes the sum of every block it wrote, and each copy that
//! reads one back (a restore) computes the sums of what it read and compares: a block that
//! does not match makes the restore refused. The CUDA copy kernels compute the same sums while
//! they move the bytes (`kernels/page_copy.cu`), so checking costs no extra pass over memory.
//!
//! The sum of a block is `Σ mix(wᵢ ⊕ (i + 1)·φ) mod 2⁶⁴` over its little-endian 64-bit words
//! `wᵢ`, where `mix` is SplitMix64's finaliser (a bijection of `u64`) and φ the 64-bit golden
//! ratio. A sum parallelises in any order (blocks of threads add partial sums), each word's term
//! depends on its place, and, since `mix` is a bijection for every place, any change confined to
//! one word always changes the sum; wider damage escapes it with probability about 2⁻⁶⁴. Like
//! CRC-32 it guards against corrupt memory, transfers and files, not against a forger.

/// The 64-bit golden ratio, which spreads word places over the input of `mix`.
pub const PLACE_STEP: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser.
#[inline]
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The sum of one block. Its length must be a whole number of 64-bit words.
pub fn block_sum(block: &[u8]) -> u64 {
    assert!(
        block.len().is_multiple_of(8),
        "a block of {} bytes is not whole 64-bit words",
        block.len()
    );
    block
        .chunks_exact(8)
        .enumerate()
        .fold(0u64, |sum, (i, word)| {
            let word = u64::from_le_bytes(word.try_into().expect("chunks of 8"));
            sum.wrapping_add(mix(word ^ (i as u64 + 1).wrapping_mul(PLACE_STEP)))
        })
}

/// The sums of every block of `bytes`, blocks of `block_bytes` in order.
pub fn block_sums(bytes: &[u8], block_bytes: usize) -> Vec<u64> {
    assert!(
        block_bytes > 0 && bytes.len().is_multiple_of(block_bytes),
        "{} bytes are not whole blocks of {block_bytes}",
        bytes.len()
    );
    bytes.chunks_exact(block_bytes).map(block_sum).collect()
}

/// [`block_sums`] on up to `threads` threads: what reading a snapshot of gigabytes from disk
/// needs to keep up with the disk.
pub fn block_sums_parallel(bytes: &[u8], block_bytes: usize, threads: usize) -> Vec<u64> {
    let blocks = bytes.len() / block_bytes.max(1);
    let threads = threads.clamp(1, blocks.max(1));
    if threads == 1 {
        return block_sums(bytes, block_bytes);
    }
    let per_thread = blocks.div_ceil(threads) * block_bytes;
    std::thread::scope(|scope| {
        let parts: Vec<_> = bytes
            .chunks(per_thread)
            .map(|part| scope.spawn(move || block_sums(part, block_bytes)))
            .collect();
        parts
            .into_iter()
            .flat_map(|part| part.join().expect("a checksum thread does not panic"))
            .collect()
    })
}

/// One value for a whole snapshot from its block sums, in order (what a frame carries).
pub fn fold_sums(sums: &[u64]) -> u64 {
    sums.iter().enumerate().fold(0u64, |all, (i, &sum)| {
        all.wrapping_add(mix(sum ^ (i as u64 + 1).wrapping_mul(PLACE_STEP)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        (0..n as u64).map(|i| (mix(i ^ seed) >> 7) as u8).collect()
    }

    #[test]
    fn every_single_bit_flip_changes_the_sum_of_its_block() {
        let block = bytes(256, 1);
        let sum = block_sum(&block);
        for bit in 0..block.len() * 8 {
            let mut flipped = block.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(block_sum(&flipped), sum, "bit {bit}");
        }
    }

    #[test]
    fn swapping_two_words_changes_the_sum() {
        let block = bytes(64, 2);
        let mut swapped = block.clone();
        let (a, b) = swapped.split_at_mut(8);
        a[..8].swap_with_slice(&mut b[..8]);
        assert_ne!(swapped, block);
        assert_ne!(block_sum(&swapped), block_sum(&block));
    }

    #[test]
    fn a_known_value_pins_the_definition() {
        // The CUDA kernels compute this too; kernel tests compare against `block_sum`.
        let block: Vec<u8> = (0u8..16).collect();
        let w0 = u64::from_le_bytes(block[..8].try_into().unwrap());
        let w1 = u64::from_le_bytes(block[8..].try_into().unwrap());
        let expected = mix(w0 ^ PLACE_STEP).wrapping_add(mix(w1 ^ PLACE_STEP.wrapping_mul(2)));
        assert_eq!(block_sum(&block), expected);
        assert_eq!(mix(0), 0);
        assert_eq!(mix(1), 0x5692_161D_100B_05E5);
    }

    #[test]
    fn parallel_sums_equal_serial_ones() {
        let all = bytes(64 * 37, 3);
        let serial = block_sums(&all, 64);
        for threads in [1, 2, 3, 8, 64] {
            assert_eq!(block_sums_parallel(&all, 64, threads), serial);
        }
    }

    #[test]
    fn the_fold_depends_on_order() {
        assert_ne!(fold_sums(&[1, 2]), fold_sums(&[2, 1]));
    }
}
