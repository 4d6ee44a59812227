//! The disk tier's file format: one snapshot per file, self-describing and self-checking.
//!
//! Owns the layout and its validation, never the I/O. A file is a fixed header, two tables
//! (the chained hash of every page, the sum of every block: [`crate::checksum`]) and the
//! payload, the snapshot's pages as the memory tiers hold them. A reader trusts nothing it has
//! not checked: the header by its own CRC-32 and by the model and geometry it expects, the
//! tables by theirs, the file's length against what the header declares (a file cut short by
//! a crash is refused), and the payload block by block against the table as it is read.
//!
//! Header, version 1, 128 bytes, little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `SSNP` |
//! | 4 | 2 | version (1) |
//! | 6 | 2 | header length (128) |
//! | 8 | 16 | model fingerprint (the prefix salt: model and adapter) |
//! | 24 | 8 | snapshot id when written |
//! | 32 | 8 | pages |
//! | 40 | 8 | payload bytes |
//! | 48 | 4 × 4 | layers, KV heads, head dim, page tokens |
//! | 64 | 1 | dtype bytes |
//! | 65 | 1 | flags: bit 0 kept by an operator |
//! | 66 | 6 | reserved, zero |
//! | 72 | 8 | fixed per-sequence state bytes |
//! | 80 | 16 | prefix hash: the chain's last page |
//! | 96 | 8 | payload checksum: the fold of the block sums |
//! | 104 | 8 | last use, Unix milliseconds |
//! | 112 | 4 | CRC-32 of the tables |
//! | 116 | 8 | reserved, zero |
//! | 124 | 4 | CRC-32 of bytes 0..124 |

use crate::checksum::fold_sums;
use crate::error::CacheError;
use crate::geometry::{KvGeometry, SnapshotGeometry};
use crate::ids::SnapshotId;
use crate::prefix::PrefixHash;

const MAGIC: [u8; 4] = *b"SSNP";
const VERSION: u16 = 1;
/// Bytes of a version-1 header.
pub const HEADER_LEN: usize = 128;
const HEADER_CRC_AT: usize = HEADER_LEN - 4;

/// Blocks of one snapshot page: each layer's K and V.
pub fn page_blocks(kv: &KvGeometry) -> usize {
    2 * kv.layers
}

/// Bytes of one block.
pub fn block_bytes(kv: &KvGeometry) -> usize {
    kv.page_tokens * kv.token_elems_per_layer() * kv.dtype_bytes
}

/// A snapshot file's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    pub model: u128,
    pub snapshot: SnapshotId,
    pub geometry: SnapshotGeometry,
    pub pages: u64,
    pub payload_bytes: u64,
    pub kept: bool,
    pub last_used_ms: u64,
    pub prefix: PrefixHash,
    pub payload_sum: u64,
    tables_crc: u32,
}

/// The tables after the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileTables {
    /// The chained hash of every page.
    pub chain: Vec<PrefixHash>,
    /// The sum of every block, in payload order.
    pub sums: Vec<u64>,
}

impl FileTables {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.chain.len() * 16 + self.sums.len() * 8);
        for hash in &self.chain {
            out.extend_from_slice(&hash.0.to_le_bytes());
        }
        for sum in &self.sums {
            out.extend_from_slice(&sum.to_le_bytes());
        }
        out
    }
}

impl FileHeader {
    /// The header and encoded tables of a file holding a snapshot of `tables.chain.len()`
    /// pages of `geometry`, whose blocks sum to `tables.sums`.
    pub fn new(
        model: u128,
        snapshot: SnapshotId,
        geometry: SnapshotGeometry,
        tables: &FileTables,
        kept: bool,
        last_used_ms: u64,
    ) -> Result<(FileHeader, Vec<u8>), CacheError> {
        let pages = tables.chain.len();
        let prefix = *tables.chain.last().ok_or(CacheError::EmptyPrefix)?;
        if tables.sums.len() != pages * page_blocks(&geometry.kv) || geometry.fixed_state_bytes > 0
        {
            return Err(CacheError::FileTables);
        }
        let encoded = tables.encode();
        let header = FileHeader {
            model,
            snapshot,
            geometry,
            pages: pages as u64,
            payload_bytes: geometry.bytes_for_pages(pages),
            kept,
            last_used_ms,
            prefix,
            payload_sum: fold_sums(&tables.sums),
            tables_crc: crc32fast::hash(&encoded),
        };
        Ok((header, encoded))
    }

    /// Bytes of the tables after the header.
    pub fn tables_len(&self) -> u64 {
        self.pages * 16 + self.pages * page_blocks(&self.geometry.kv) as u64 * 8
    }

    /// Where the payload starts.
    pub fn payload_offset(&self) -> u64 {
        HEADER_LEN as u64 + self.tables_len()
    }

    /// The length of a whole file.
    pub fn file_len(&self) -> u64 {
        self.payload_offset() + self.payload_bytes
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let kv = &self.geometry.kv;
        let mut out = Vec::with_capacity(HEADER_LEN);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        out.extend_from_slice(&self.model.to_le_bytes());
        for value in [self.snapshot.0, self.pages, self.payload_bytes] {
            out.extend_from_slice(&value.to_le_bytes());
        }
        for value in [kv.layers, kv.kv_heads, kv.head_dim, kv.page_tokens] {
            out.extend_from_slice(&(value as u32).to_le_bytes());
        }
        out.push(kv.dtype_bytes as u8);
        out.push(u8::from(self.kept));
        out.extend_from_slice(&[0; 6]);
        out.extend_from_slice(&self.geometry.fixed_state_bytes.to_le_bytes());
        out.extend_from_slice(&self.prefix.0.to_le_bytes());
        out.extend_from_slice(&self.payload_sum.to_le_bytes());
        out.extend_from_slice(&self.last_used_ms.to_le_bytes());
        out.extend_from_slice(&self.tables_crc.to_le_bytes());
        out.extend_from_slice(&[0; 8]);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out.try_into()
            .expect("the layout above writes exactly HEADER_LEN bytes")
    }

    /// Decodes a header and checks it was written for `model` and `geometry`. Never panics.
    pub fn decode(
        bytes: &[u8],
        model: u128,
        geometry: &SnapshotGeometry,
    ) -> Result<FileHeader, CacheError> {
        if bytes.len() < HEADER_LEN {
            return Err(CacheError::FrameTruncated {
                needed: HEADER_LEN,
                found: bytes.len(),
            });
        }
        let bytes = &bytes[..HEADER_LEN];
        let magic: [u8; 4] = bytes[..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(CacheError::FrameMagic { found: magic });
        }
        let u16_at = |at: usize| u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2"));
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let u128_at = |at: usize| u128::from_le_bytes(bytes[at..at + 16].try_into().expect("16"));
        if u16_at(4) != VERSION {
            return Err(CacheError::FrameVersion { found: u16_at(4) });
        }
        if usize::from(u16_at(6)) != HEADER_LEN {
            return Err(CacheError::FrameHeaderLength {
                declared: u16_at(6),
                expected: HEADER_LEN as u16,
            });
        }
        let (stored, computed) = (
            u32_at(HEADER_CRC_AT),
            crc32fast::hash(&bytes[..HEADER_CRC_AT]),
        );
        if stored != computed {
            return Err(CacheError::FrameHeaderChecksum { stored, computed });
        }
        let found_model = u128_at(8);
        if found_model != model {
            return Err(CacheError::FileModel {
                found: found_model,
                expected: model,
            });
        }
        let found = SnapshotGeometry {
            kv: KvGeometry {
                layers: u32_at(48) as usize,
                kv_heads: u32_at(52) as usize,
                head_dim: u32_at(56) as usize,
                page_tokens: u32_at(60) as usize,
                dtype_bytes: bytes[64].into(),
            },
            fixed_state_bytes: u64_at(72),
        };
        if found != *geometry {
            return Err(CacheError::FrameGeometry {
                frame: Box::new(found),
                expected: Box::new(*geometry),
            });
        }
        let pages = u64_at(32);
        let payload_bytes = u64_at(40);
        let expected = geometry.checked_bytes_for_pages(pages);
        if pages == 0 || expected != Some(payload_bytes) {
            return Err(CacheError::FrameByteLength {
                declared: payload_bytes,
                expected,
            });
        }
        if bytes[65] > 1 {
            return Err(CacheError::FrameField {
                field: "flags",
                value: bytes[65].into(),
            });
        }
        Ok(FileHeader {
            model,
            snapshot: SnapshotId(u64_at(24)),
            geometry: found,
            pages,
            payload_bytes,
            kept: bytes[65] == 1,
            last_used_ms: u64_at(104),
            prefix: PrefixHash(u128_at(80)),
            payload_sum: u64_at(96),
            tables_crc: u32_at(112),
        })
    }

    /// Decodes and checks the tables that follow this header.
    pub fn decode_tables(&self, bytes: &[u8]) -> Result<FileTables, CacheError> {
        if bytes.len() as u64 != self.tables_len() || crc32fast::hash(bytes) != self.tables_crc {
            return Err(CacheError::FileTables);
        }
        let pages = self.pages as usize;
        let (chain, sums) = bytes.split_at(pages * 16);
        let chain: Vec<PrefixHash> = chain
            .chunks_exact(16)
            .map(|c| PrefixHash(u128::from_le_bytes(c.try_into().expect("16 bytes"))))
            .collect();
        let sums: Vec<u64> = sums
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        if chain.last() != Some(&self.prefix) || fold_sums(&sums) != self.payload_sum {
            return Err(CacheError::FileTables);
        }
        Ok(FileTables { chain, sums })
    }

    /// Checks a file's length against this header: a file cut short (or grown) is refused.
    pub fn check_file_len(&self, found: u64) -> Result<(), CacheError> {
        if found != self.file_len() {
            return Err(CacheError::FileLength {
                declared: self.file_len(),
                found,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::block_sums;

    fn geometry() -> SnapshotGeometry {
        SnapshotGeometry {
            kv: KvGeometry {
                layers: 2,
                kv_heads: 1,
                head_dim: 4,
                page_tokens: 2,
                dtype_bytes: 2,
            },
            fixed_state_bytes: 0,
        }
    }

    fn file() -> (FileHeader, Vec<u8>, Vec<u8>) {
        let g = geometry();
        let payload: Vec<u8> = (0..g.bytes_for_pages(3) as usize)
            .map(|i| (i * 7) as u8)
            .collect();
        let tables = FileTables {
            chain: (1..=3).map(|i| PrefixHash(i * 1_000_003)).collect(),
            sums: block_sums(&payload, block_bytes(&g.kv)),
        };
        let (header, encoded) = FileHeader::new(9, SnapshotId(4), g, &tables, true, 77).unwrap();
        (header, encoded, payload)
    }

    #[test]
    fn a_header_and_its_tables_round_trip() {
        let (header, tables, payload) = file();
        let decoded = FileHeader::decode(&header.encode(), 9, &geometry()).unwrap();
        assert_eq!(decoded, header);
        let tables = decoded.decode_tables(&tables).unwrap();
        assert_eq!(
            tables.sums,
            block_sums(&payload, block_bytes(&geometry().kv))
        );
        assert_eq!(
            header.file_len(),
            128 + 3 * 16 + 12 * 8 + payload.len() as u64
        );
        assert!(header.check_file_len(header.file_len()).is_ok());
        assert!(header.check_file_len(header.file_len() - 1).is_err());
    }

    #[test]
    fn every_flipped_header_or_table_bit_is_refused() {
        let (header, tables, _) = file();
        let bytes = header.encode();
        for bit in 0..bytes.len() * 8 {
            let mut flipped = bytes;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(
                FileHeader::decode(&flipped, 9, &geometry()).is_err(),
                "header bit {bit}"
            );
        }
        for bit in 0..tables.len() * 8 {
            let mut flipped = tables.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(header.decode_tables(&flipped).is_err(), "table bit {bit}");
        }
        assert!(header.decode_tables(&tables[..tables.len() - 1]).is_err());
    }

    #[test]
    fn another_model_or_geometry_is_refused() {
        let (header, _, _) = file();
        let bytes = header.encode();
        assert!(matches!(
            FileHeader::decode(&bytes, 10, &geometry()),
            Err(CacheError::FileModel { .. })
        ));
        let mut other = geometry();
        other.kv.layers = 3;
        assert!(matches!(
            FileHeader::decode(&bytes, 9, &other),
            Err(CacheError::FrameGeometry { .. })
        ));
        assert!(FileHeader::decode(&bytes[..100], 9, &geometry()).is_err());
    }
}
