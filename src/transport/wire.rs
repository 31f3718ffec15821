//! The frame header of the network transport's connections and shared-memory rings (the
//! handshake that opens a connection is `crate::cluster::auth`).
//!
//! Every frame starts with [`HDR`] bytes: kind, aux, payload length, and the identity of the call
//! it belongs to ([`CallHeader::ident`]). The receiver compares that identity with its own call's
//! before it takes a byte of the payload, so a call's check travels with its data: a mismatched
//! call is caught by the first frame of it that a peer receives, without a round of its own.

use super::CallHeader;

/// Frame kinds.
pub(crate) const FRAME_HEADER: u32 = 1;
pub(crate) const FRAME_DATA: u32 = 2;
pub(crate) const FRAME_ABORT: u32 = 3;

/// Bytes of a frame header.
pub(crate) const HDR: usize = 64;
/// Bytes of a call's identity inside a frame header.
pub(crate) const IDENT: usize = 48;

/// A call's identity as it travels in frame headers.
pub(crate) type Ident = [u8; IDENT];

/// The identity of a transport's current call, which its frames carry: set by the thread that
/// runs the call, read by one that tells the peers why this rank gave up.
#[derive(Default)]
pub(crate) struct CurrentIdent([std::sync::atomic::AtomicU64; IDENT / 8]);

impl CurrentIdent {
    pub(crate) fn get(&self) -> Ident {
        let mut v = [0u8; IDENT];
        for (c, w) in v.chunks_exact_mut(8).zip(&self.0) {
            c.copy_from_slice(&w.load(std::sync::atomic::Ordering::Relaxed).to_le_bytes());
        }
        v
    }

    pub(crate) fn set(&self, v: &Ident) {
        for (c, w) in v.chunks_exact(8).zip(&self.0) {
            let mut word = [0u8; 8];
            word.copy_from_slice(c);
            w.store(
                u64::from_le_bytes(word),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
    }
}

/// A frame header: kind, aux, payload length (little endian), then the call's identity.
pub(crate) fn frame(kind: u32, aux: u32, len: u64, ident: &Ident) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[4..8].copy_from_slice(&aux.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h[16..].copy_from_slice(ident);
    h
}

/// Decode a frame header's kind, aux and length.
pub(crate) fn parse_frame(h: &[u8; HDR]) -> (u32, u32, u64) {
    let kind = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    let aux = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    (kind, aux, len)
}

/// The call identity of a frame header.
pub(crate) fn frame_ident(h: &[u8; HDR]) -> &Ident {
    h[16..].try_into().expect("IDENT bytes")
}

impl CallHeader {
    /// The fields every rank must agree on, packed into [`IDENT`] bytes (the `rejected` message
    /// travels separately).
    pub(crate) fn ident(&self) -> Ident {
        let mut v = [0u8; IDENT];
        let (algo, param) = self.algorithm.code();
        v[..8].copy_from_slice(&self.call.to_le_bytes());
        v[8..16].copy_from_slice(&(self.count as u64).to_le_bytes());
        // A collective has a root or counts, never both: they share the field.
        let root_or_counts = match (self.root, self.counts) {
            (Some(r), _) => r as u64,
            (None, Some(d)) => d,
            (None, None) => u64::MAX,
        };
        v[16..24].copy_from_slice(&root_or_counts.to_le_bytes());
        v[24..32].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        v[32..40].copy_from_slice(&param.to_le_bytes());
        v[40] = self.collective as u8;
        v[41] = self.dtype as u8;
        v[42] = self.op.map_or(u8::MAX, |o| o as u8);
        v[43] = algo;
        v[44] = u8::from(self.full_check) | u8::from(self.deterministic) << 1;
        v[45] = self.compression.code();
        v[46..48].copy_from_slice(&self.tuning.to_le_bytes());
        v
    }

    /// A header from an identity (no `rejected` message), or `None` when it is not one.
    pub(crate) fn from_ident(v: &Ident) -> Option<CallHeader> {
        let u64_ = |r: std::ops::Range<usize>| u64::from_le_bytes(v[r].try_into().expect("8"));
        let collective = crate::error::Collective::from_u32(v[40].into())?;
        let (root, counts) = match u64_(16..24) {
            d if collective.has_counts() => (None, Some(d)),
            u64::MAX => (None, None),
            r => (Some(usize::try_from(r).ok()?), None),
        };
        Some(CallHeader {
            call: u64_(0..8),
            count: usize::try_from(u64_(8..16)).ok()?,
            root,
            counts,
            chunk_bytes: u64_(24..32),
            collective,
            dtype: crate::dtype::DType::from_u32(v[41].into())?,
            op: match v[42] {
                u8::MAX => None,
                o => Some(crate::dtype::ReduceOp::from_u32(o.into())?),
            },
            algorithm: crate::call::Algorithm::from_code(v[43], u64_(32..40))?,
            full_check: match v[44] {
                f @ 0..=3 => f & 1 != 0,
                _ => return None,
            },
            deterministic: v[44] & 2 != 0,
            compression: crate::call::Compression::from_code(v[45])?,
            tuning: u16::from_le_bytes([v[46], v[47]]),
            rejected: None,
        })
    }
}

/// Whether a frame belongs to this rank's call (the same call number), whatever else its
/// identity says: a peer that rejected its own arguments states a call whose fields may differ
/// from this rank's (no elements, the op it was refused), and its reason is the news.
pub(crate) fn same_call(theirs: &Ident, mine: &Ident) -> bool {
    theirs[..8] == mine[..8]
}

/// The error for a frame whose call identity differs from this rank's call: a `Mismatch` naming
/// the first field that differs.
pub(crate) fn mismatch(
    site: crate::error::Site,
    peer: usize,
    theirs: &Ident,
    mine: &Ident,
) -> crate::error::Error {
    let (Some(t), Some(m)) = (CallHeader::from_ident(theirs), CallHeader::from_ident(mine)) else {
        return crate::error::Error::invalid(
            site,
            format!("rank {peer} sent a frame whose call this rank cannot read"),
        );
    };
    match m.first_difference(&t) {
        Some((field, mine, theirs)) => crate::error::Error::Mismatch {
            site,
            peer,
            field,
            mine,
            theirs,
        },
        None => {
            crate::error::Error::invalid(site, format!("rank {peer} is out of step with this rank"))
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any 64 bytes decode to a kind, aux and length, and to a call or to `None`; a call
        /// decoded re-encodes to one that decodes the same, and comparing it with this rank's
        /// call names a field or nothing, never panics.
        #[test]
        fn any_frame_header_decodes_or_is_refused(h in any::<[u8; 32]>(), t in any::<[u8; 32]>()) {
            let mut b = [0u8; HDR];
            b[..32].copy_from_slice(&h);
            b[32..].copy_from_slice(&t);
            let (kind, aux, len) = parse_frame(&b);
            prop_assert_eq!(frame(kind, aux, len, frame_ident(&b)), b);
            if let Some(c) = CallHeader::from_ident(frame_ident(&b)) {
                prop_assert_eq!(CallHeader::from_ident(&c.ident()), Some(c.clone()));
                let mine = CallHeader::from_ident(&[0; IDENT]);
                if let Some(m) = mine {
                    let _ = m.first_difference(&c);
                }
                let _ = c.first_difference(&c);
                let _ = c.algorithm.to_string();
            }
        }

        /// A valid call's frame, with bytes flipped: decoded or refused, never a panic; a change
        /// that still decodes shows as a difference.
        #[test]
        fn mutated_frames_decode_or_are_refused(
            call in any::<u64>(),
            count in 0usize..1 << 40,
            root in proptest::option::of(0usize..1024),
            algo in 0u8..5,
            param in 0u64..64,
            collective in 0u32..16,
            dtype in 0u32..16,
            op in proptest::option::of(0u32..8),
            edits in proptest::collection::vec((0usize..HDR, 1..=255u8), 0..4),
        ) {
            let (Some(collective), Some(dtype), Some(algorithm)) = (
                crate::error::Collective::from_u32(collective),
                crate::dtype::DType::from_u32(dtype),
                crate::call::Algorithm::from_code(algo, param),
            ) else {
                return Ok(());
            };
            let op = match op {
                Some(o) => match crate::dtype::ReduceOp::from_u32(o) {
                    Some(o) => Some(o),
                    None => return Ok(()),
                },
                None => None,
            };
            // A collective with counts states their digest where others state a root.
            let (root, counts) = if collective.has_counts() {
                (None, Some(root.map_or(u64::MAX, |r| (r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))))
            } else {
                (root, None)
            };
            let c = CallHeader {
                call,
                collective,
                dtype,
                count,
                op,
                root,
                counts,
                algorithm,
                chunk_bytes: param << 10,
                full_check: call % 2 == 0,
                deterministic: call % 3 == 0,
                compression: crate::call::Compression::from_code((call % 3) as u8).unwrap_or_default(),
                tuning: (call >> 7) as u16,
                rejected: None,
            };
            let mut b = frame(FRAME_DATA, 7, count as u64, &c.ident());
            prop_assert_eq!(parse_frame(&b), (FRAME_DATA, 7, count as u64));
            prop_assert_eq!(CallHeader::from_ident(frame_ident(&b)), Some(c.clone()));
            for (i, x) in &edits {
                b[*i] ^= x;
            }
            let _ = parse_frame(&b);
            if let Some(t) = CallHeader::from_ident(frame_ident(&b)) {
                if t != c {
                    prop_assert!(c.first_difference(&t).is_some(), "{c:?} and {t:?} differ unseen");
                }
            }
        }
    }
}
