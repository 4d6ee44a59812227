//! Frames: the self-checking record of one save or restore.
//!
//! Owns the frame's fields, its versioned little-endian encoding and its validation. A frame
//! travels ahead of a snapshot's bytes (to a tier, a disk file, a tensor-parallel peer), and the
//! receiver validates all of it before trusting any of it: decoding never panics, whatever the
//! input, and every truncated, corrupted or inconsistent frame is a typed error. The frame never
//! carries the KV bytes themselves, only their length and checksum.
//!
//! Layout, version 1, 88 bytes, little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `SSFR` |
//! | 4 | 2 | version (1) |
//! | 6 | 2 | header length (88) |
//! | 8 | 1 | kind: 1 save, 2 restore |
//! | 9 | 1 | dtype bytes (1, 2 or 4) |
//! | 10 | 2 | reserved, zero |
//! | 12 | 4 | slot |
//! | 16 | 8 | slot generation |
//! | 24 | 8 | snapshot id |
//! | 32 | 8 | base: first position covered, in tokens |
//! | 40 | 8 | position: end of the covered positions, in tokens |
//! | 48 | 8 | payload length in bytes |
//! | 56 | 8 | fixed per-sequence state bytes |
//! | 64 | 4 × 4 | layers, KV heads, head dim, page tokens |
//! | 80 | 4 | CRC-32 of the payload |
//! | 84 | 4 | CRC-32 of bytes 0..84 |
//!
//! CRC-32 (IEEE) detects every single-bit error and every burst up to 32 bits, which is what a
//! corrupt transfer looks like; it is not a defence against a forger, and peers and our own
//! disk are trusted.

use crate::error::CacheError;
use crate::geometry::{KvGeometry, SnapshotGeometry};
use crate::ids::{Generation, SlotHandle, SlotId, SnapshotId};

const MAGIC: [u8; 4] = *b"SSFR";
const VERSION: u16 = 1;
/// Bytes of an encoded version-1 frame.
pub const FRAME_LEN: usize = 88;
/// Bytes a receiver reads before it knows the version and length.
const PREAMBLE_LEN: usize = 8;
const HEADER_CRC_AT: usize = FRAME_LEN - 4;

/// Which way the bytes went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Working pool to snapshot buffer.
    Save,
    /// Snapshot buffer to working pool.
    Restore,
}

impl FrameKind {
    fn code(self) -> u8 {
        match self {
            FrameKind::Save => 1,
            FrameKind::Restore => 2,
        }
    }

    fn from_code(code: u8) -> Result<FrameKind, CacheError> {
        match code {
            1 => Ok(FrameKind::Save),
            2 => Ok(FrameKind::Restore),
            _ => Err(CacheError::FrameField {
                field: "kind",
                value: code.into(),
            }),
        }
    }
}

/// The record of one save or restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub snapshot: SnapshotId,
    pub slot: SlotHandle,
    /// First position covered, in tokens: 0 for a prefix snapshot.
    pub base_tokens: u64,
    /// End of the positions covered, in tokens.
    pub position_tokens: u64,
    pub byte_len: u64,
    pub payload_crc32: u32,
    pub geometry: SnapshotGeometry,
}

/// The CRC-32 a frame carries for `payload`.
pub fn payload_crc32(payload: &[u8]) -> u32 {
    crc32fast::hash(payload)
}

impl Frame {
    /// A frame for a prefix snapshot (base 0) of `position_tokens` positions.
    pub fn new(
        kind: FrameKind,
        snapshot: SnapshotId,
        slot: SlotHandle,
        position_tokens: u64,
        byte_len: u64,
        payload_crc32: u32,
        geometry: SnapshotGeometry,
    ) -> Frame {
        Frame {
            kind,
            snapshot,
            slot,
            base_tokens: 0,
            position_tokens,
            byte_len,
            payload_crc32,
            geometry,
        }
    }

    /// Checks that the fields agree with each other: a page-aligned range, and a byte length
    /// equal to what the geometry gives for it.
    pub fn validate(&self) -> Result<(), CacheError> {
        let kv = &self.geometry.kv;
        for (field, value) in [
            ("layers", kv.layers),
            ("kv_heads", kv.kv_heads),
            ("head_dim", kv.head_dim),
            ("page_tokens", kv.page_tokens),
        ] {
            if value == 0 {
                return Err(CacheError::FrameField { field, value: 0 });
            }
        }
        if !matches!(kv.dtype_bytes, 1 | 2 | 4) {
            return Err(CacheError::FrameField {
                field: "dtype_bytes",
                value: kv.dtype_bytes as u64,
            });
        }
        let (base, position, page) = (
            self.base_tokens,
            self.position_tokens,
            kv.page_tokens as u64,
        );
        if base > position || base % page != 0 || position % page != 0 {
            return Err(CacheError::FrameRange {
                base_tokens: base,
                position_tokens: position,
                page_tokens: page,
            });
        }
        let expected = self
            .geometry
            .checked_bytes_for_pages((position - base) / page);
        if expected != Some(self.byte_len) {
            return Err(CacheError::FrameByteLength {
                declared: self.byte_len,
                expected,
            });
        }
        Ok(())
    }

    /// Checks that the frame was written for the receiver's model.
    pub fn check_geometry(&self, expected: &SnapshotGeometry) -> Result<(), CacheError> {
        if self.geometry != *expected {
            let (frame, expected) = (Box::new(self.geometry), Box::new(*expected));
            return Err(CacheError::FrameGeometry { frame, expected });
        }
        Ok(())
    }

    /// Checks the bytes that followed the frame.
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), CacheError> {
        if payload.len() as u64 != self.byte_len {
            return Err(CacheError::PayloadLength {
                declared: self.byte_len,
                found: payload.len() as u64,
            });
        }
        let computed = payload_crc32(payload);
        if computed != self.payload_crc32 {
            return Err(CacheError::PayloadChecksum {
                stored: self.payload_crc32,
                computed,
            });
        }
        Ok(())
    }
}

impl Frame {
    /// The version-1 encoding. Refuses a frame that does not validate, so nothing inconsistent
    /// is ever sent.
    pub fn encode(&self) -> Result<[u8; FRAME_LEN], CacheError> {
        self.validate()?;
        let kv = &self.geometry.kv;
        let mut out = Writer(Vec::with_capacity(FRAME_LEN));
        out.bytes(&MAGIC);
        out.bytes(&VERSION.to_le_bytes());
        out.bytes(&(FRAME_LEN as u16).to_le_bytes());
        out.bytes(&[self.kind.code(), kv.dtype_bytes as u8, 0, 0]);
        out.bytes(&self.slot.slot.0.to_le_bytes());
        for value in [
            self.slot.generation.0,
            self.snapshot.0,
            self.base_tokens,
            self.position_tokens,
            self.byte_len,
            self.geometry.fixed_state_bytes,
        ] {
            out.bytes(&value.to_le_bytes());
        }
        for (field, value) in [
            ("layers", kv.layers),
            ("kv_heads", kv.kv_heads),
            ("head_dim", kv.head_dim),
            ("page_tokens", kv.page_tokens),
        ] {
            let narrow = u32::try_from(value).map_err(|_| CacheError::FrameField {
                field,
                value: value as u64,
            })?;
            out.bytes(&narrow.to_le_bytes());
        }
        out.bytes(&self.payload_crc32.to_le_bytes());
        let header_crc = crc32fast::hash(&out.0);
        out.bytes(&header_crc.to_le_bytes());
        Ok(out
            .0
            .try_into()
            .expect("the layout above writes exactly FRAME_LEN bytes"))
    }

    /// Decodes and validates exactly one encoded frame. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Frame, CacheError> {
        check_preamble(bytes)?;
        if bytes.len() < FRAME_LEN {
            return Err(CacheError::FrameTruncated {
                needed: FRAME_LEN,
                found: bytes.len(),
            });
        }
        if bytes.len() > FRAME_LEN {
            return Err(CacheError::FrameTrailingBytes {
                expected: FRAME_LEN,
                found: bytes.len(),
            });
        }
        let mut crc = Reader {
            bytes,
            at: HEADER_CRC_AT,
        };
        let (stored, computed) = (crc.u32(), crc32fast::hash(&bytes[..HEADER_CRC_AT]));
        if stored != computed {
            return Err(CacheError::FrameHeaderChecksum { stored, computed });
        }
        let frame = read_fields(&mut Reader {
            bytes,
            at: PREAMBLE_LEN,
        })?;
        frame.validate()?;
        Ok(frame)
    }
}

/// Magic, version and declared length: enough to know the rest can be read.
fn check_preamble(bytes: &[u8]) -> Result<(), CacheError> {
    if bytes.len() < PREAMBLE_LEN {
        return Err(CacheError::FrameTruncated {
            needed: PREAMBLE_LEN,
            found: bytes.len(),
        });
    }
    let mut preamble = Reader { bytes, at: 0 };
    let magic: [u8; 4] = preamble.take();
    if magic != MAGIC {
        return Err(CacheError::FrameMagic { found: magic });
    }
    let version = preamble.u16();
    if version != VERSION {
        return Err(CacheError::FrameVersion { found: version });
    }
    let declared = preamble.u16();
    if usize::from(declared) != FRAME_LEN {
        return Err(CacheError::FrameHeaderLength {
            declared,
            expected: FRAME_LEN as u16,
        });
    }
    Ok(())
}

fn read_fields(input: &mut Reader<'_>) -> Result<Frame, CacheError> {
    let [kind, dtype_bytes, reserved_lo, reserved_hi] = input.take();
    let kind = FrameKind::from_code(kind)?;
    let reserved = u16::from_le_bytes([reserved_lo, reserved_hi]);
    if reserved != 0 {
        return Err(CacheError::FrameField {
            field: "reserved",
            value: reserved.into(),
        });
    }
    let slot = SlotId(input.u32());
    let generation = Generation(input.u64());
    let snapshot = SnapshotId(input.u64());
    let (base_tokens, position_tokens, byte_len) = (input.u64(), input.u64(), input.u64());
    let fixed_state_bytes = input.u64();
    let kv = KvGeometry {
        layers: input.u32() as usize,
        kv_heads: input.u32() as usize,
        head_dim: input.u32() as usize,
        page_tokens: input.u32() as usize,
        dtype_bytes: dtype_bytes.into(),
    };
    Ok(Frame {
        kind,
        snapshot,
        slot: SlotHandle { slot, generation },
        base_tokens,
        position_tokens,
        byte_len,
        payload_crc32: input.u32(),
        geometry: SnapshotGeometry {
            kv,
            fixed_state_bytes,
        },
    })
}

struct Writer(Vec<u8>);

impl Writer {
    fn bytes(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

/// Reads fixed-size little-endian fields from input whose length was checked first.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let field = self.bytes[self.at..self.at + N]
            .try_into()
            .expect("fields are read only from input whose length was checked");
        self.at += N;
        field
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> SnapshotGeometry {
        SnapshotGeometry {
            kv: KvGeometry {
                layers: 2,
                kv_heads: 2,
                head_dim: 4,
                page_tokens: 4,
                dtype_bytes: 2,
            },
            fixed_state_bytes: 6,
        }
    }

    fn frame() -> Frame {
        let slot = SlotHandle {
            slot: SlotId(3),
            generation: Generation(9),
        };
        let payload = payload();
        Frame::new(
            FrameKind::Save,
            SnapshotId(42),
            slot,
            8,
            payload.len() as u64,
            payload_crc32(&payload),
            geometry(),
        )
    }

    /// 8 tokens * (2 * 2 layers * 2 heads * 4 dims * 2 bytes) + 6 fixed.
    fn payload() -> Vec<u8> {
        (0..8 * 64 + 6).map(|i| i as u8).collect()
    }

    #[test]
    fn a_frame_round_trips_and_its_payload_checks() {
        let frame = frame();
        let bytes = frame.encode().unwrap();
        assert_eq!(&bytes[..4], b"SSFR");
        assert_eq!(Frame::decode(&bytes).unwrap(), frame);
        frame.check_payload(&payload()).unwrap();
        frame.check_geometry(&geometry()).unwrap();
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = frame().encode().unwrap();
        for len in 0..FRAME_LEN {
            let err = Frame::decode(&bytes[..len]).expect_err("a truncated frame is refused");
            assert!(
                matches!(err, CacheError::FrameTruncated { found, .. } if found == len),
                "{len}: {err}"
            );
        }
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert!(matches!(
            Frame::decode(&longer),
            Err(CacheError::FrameTrailingBytes { .. })
        ));
    }

    #[test]
    fn every_single_bit_flip_is_refused() {
        let bytes = frame().encode().unwrap();
        for bit in 0..FRAME_LEN * 8 {
            let mut flipped = bytes;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(
                Frame::decode(&flipped).is_err(),
                "bit {bit} flipped was accepted"
            );
        }
    }

    /// Re-seals a tampered frame with a correct header CRC, so field validation is what rejects it.
    fn resealed(mut bytes: [u8; FRAME_LEN], at: usize, value: &[u8]) -> [u8; FRAME_LEN] {
        bytes[at..at + value.len()].copy_from_slice(value);
        let crc = crc32fast::hash(&bytes[..HEADER_CRC_AT]);
        bytes[HEADER_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    #[test]
    fn inconsistent_fields_under_a_valid_checksum_are_refused() {
        let bytes = frame().encode().unwrap();
        let cases: [(usize, &[u8], &str); 7] = [
            (8, &[7], "kind"),
            (9, &[3], "dtype"),
            (10, &[1], "reserved"),
            (
                32,
                &8u64.to_le_bytes(),
                "base == position is fine but then bytes differ",
            ),
            (40, &6u64.to_le_bytes(), "position not page aligned"),
            (48, &1u64.to_le_bytes(), "byte length"),
            (64, &0u32.to_le_bytes(), "zero layers"),
        ];
        for (at, value, why) in cases {
            assert!(Frame::decode(&resealed(bytes, at, value)).is_err(), "{why}");
        }
        let huge = resealed(
            resealed(bytes, 40, &(u64::MAX - 3).to_le_bytes()),
            64,
            &u32::MAX.to_le_bytes(),
        );
        assert!(matches!(
            Frame::decode(&huge),
            Err(CacheError::FrameByteLength { expected: None, .. })
        ));
    }

    #[test]
    fn the_preamble_errors_are_specific() {
        let bytes = frame().encode().unwrap();
        assert!(matches!(
            Frame::decode(&resealed(bytes, 0, b"XXXX")),
            Err(CacheError::FrameMagic { .. })
        ));
        assert!(matches!(
            Frame::decode(&resealed(bytes, 4, &2u16.to_le_bytes())),
            Err(CacheError::FrameVersion { found: 2 })
        ));
        assert!(matches!(
            Frame::decode(&resealed(bytes, 6, &96u16.to_le_bytes())),
            Err(CacheError::FrameHeaderLength { declared: 96, .. })
        ));
    }

    #[test]
    fn a_wrong_payload_or_geometry_is_refused() {
        let frame = frame();
        let mut payload = payload();
        assert!(matches!(
            frame.check_payload(&payload[1..]),
            Err(CacheError::PayloadLength { .. })
        ));
        payload[100] ^= 0x10;
        assert!(matches!(
            frame.check_payload(&payload),
            Err(CacheError::PayloadChecksum { .. })
        ));
        let mut other = geometry();
        other.kv.dtype_bytes = 4;
        assert!(matches!(
            frame.check_geometry(&other),
            Err(CacheError::FrameGeometry { .. })
        ));
    }

    #[test]
    fn an_inconsistent_frame_is_not_encoded() {
        let mut frame = frame();
        frame.byte_len += 1;
        assert!(matches!(
            frame.encode(),
            Err(CacheError::FrameByteLength { .. })
        ));
    }
}
