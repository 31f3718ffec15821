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
        v[16..24].copy_from_slice(&self.root.map_or(u64::MAX, |r| r as u64).to_le_bytes());
        v[24..32].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        v[32..40].copy_from_slice(&param.to_le_bytes());
        v[40] = self.collective as u8;
        v[41] = self.dtype as u8;
        v[42] = self.op.map_or(u8::MAX, |o| o as u8);
        v[43] = algo;
        v[44] = u8::from(self.full_check);
        v
    }

    /// A header from an identity (no `rejected` message), or `None` when it is not one.
    pub(crate) fn from_ident(v: &Ident) -> Option<CallHeader> {
        let u64_ = |r: std::ops::Range<usize>| u64::from_le_bytes(v[r].try_into().expect("8"));
        let root = match u64_(16..24) {
            u64::MAX => None,
            r => Some(usize::try_from(r).ok()?),
        };
        Some(CallHeader {
            call: u64_(0..8),
            count: usize::try_from(u64_(8..16)).ok()?,
            root,
            chunk_bytes: u64_(24..32),
            collective: crate::error::Collective::from_u32(v[40].into())?,
            dtype: crate::dtype::DType::from_u32(v[41].into())?,
            op: match v[42] {
                u8::MAX => None,
                o => Some(crate::dtype::ReduceOp::from_u32(o.into())?),
            },
            algorithm: crate::call::Algorithm::from_code(v[43], u64_(32..40))?,
            full_check: v[44] != 0,
            rejected: None,
        })
    }
}
