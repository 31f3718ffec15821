//! The 16-byte frame header of the network transport's connections (the handshake that opens
//! them is `crate::cluster::auth`).

/// Frame kinds.
pub(crate) const FRAME_HEADER: u32 = 1;
pub(crate) const FRAME_DATA: u32 = 2;
pub(crate) const FRAME_ABORT: u32 = 3;

/// A frame header: kind, aux, payload length (little endian).
pub(crate) fn frame(kind: u32, aux: u32, len: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[4..8].copy_from_slice(&aux.to_le_bytes());
    h[8..].copy_from_slice(&len.to_le_bytes());
    h
}

/// Decode a frame header.
pub(crate) fn parse_frame(h: &[u8; 16]) -> (u32, u32, u64) {
    let kind = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    let aux = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
    (kind, aux, len)
}
