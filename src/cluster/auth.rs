//! Proving the job's secret: the handshake of every tutti connection (a mutual HMAC-SHA256
//! challenge over the job token, so the token never travels), used by the rendezvous store and
//! by the transports above it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// First bytes of every tutti connection.
pub(crate) const MAGIC: &[u8; 6] = b"TUTTI\x01";

/// What a connection is for; part of what the handshake proves.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Purpose {
    Store = 1,
    Data = 2,
}

/// 16 random bytes from the kernel.
pub(crate) fn nonce() -> Result<[u8; 16]> {
    let mut n = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| Error::io("reading /dev/urandom", e))?;
    Ok(n)
}

/// A random job token (hex), for launchers that make one.
pub fn random_token() -> Result<String> {
    Ok(nonce()?.iter().map(|b| format!("{b:02x}")).collect())
}

fn mac(token: &str, parts: &[&[u8]]) -> [u8; 32] {
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(token.as_bytes()).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

fn io<'a>(what: &'a str, peer: &'a str) -> impl Fn(std::io::Error) -> Error + 'a {
    move |e| Error::System {
        what: format!("{what} with {peer}"),
        message: e.to_string(),
    }
}

/// Accepting side: challenge the client; returns the rank it proved. Fails on wrong magic,
/// purpose or proof (the caller logs and drops such connections).
pub(crate) fn handshake_server(
    s: &mut TcpStream,
    token: &str,
    purpose: Purpose,
    timeout: Duration,
) -> Result<u32> {
    let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    s.set_read_timeout(Some(timeout))
        .and_then(|_| s.set_write_timeout(Some(timeout)))
        .map_err(io("handshake", &peer))?;
    let ns = nonce()?;
    let mut hello = Vec::with_capacity(23);
    hello.extend_from_slice(MAGIC);
    hello.push(purpose as u8);
    hello.extend_from_slice(&ns);
    s.write_all(&hello).map_err(io("handshake", &peer))?;
    let mut reply = [0u8; 6 + 4 + 16 + 32];
    s.read_exact(&mut reply).map_err(io("handshake", &peer))?;
    if &reply[..6] != MAGIC {
        return Err(Error::config(format!(
            "connection from {peer} is not a tutti peer (bad greeting)"
        )));
    }
    let rank = &reply[6..10];
    let nc = &reply[10..26];
    if reply[26..] != mac(token, &[b"client", &[purpose as u8], &ns, rank]) {
        return Err(Error::config(format!(
            "connection from {peer} failed the job-token check"
        )));
    }
    s.write_all(&mac(token, &[b"server", &[purpose as u8], nc, rank]))
        .map_err(io("handshake", &peer))?;
    Ok(u32::from_le_bytes(rank.try_into().expect("4 bytes")))
}

/// Connecting side: answer the challenge as `rank` and check the server's proof.
pub(crate) fn handshake_client(
    s: &mut TcpStream,
    token: &str,
    purpose: Purpose,
    rank: u32,
    timeout: Duration,
) -> Result<()> {
    let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    s.set_read_timeout(Some(timeout))
        .and_then(|_| s.set_write_timeout(Some(timeout)))
        .map_err(io("handshake", &peer))?;
    let mut hello = [0u8; 23];
    s.read_exact(&mut hello).map_err(io("handshake", &peer))?;
    if &hello[..6] != MAGIC || hello[6] != purpose as u8 {
        return Err(Error::config(format!(
            "{peer} is not a tutti {purpose:?} endpoint"
        )));
    }
    let nc = nonce()?;
    let r = rank.to_le_bytes();
    let mut reply = Vec::with_capacity(58);
    reply.extend_from_slice(MAGIC);
    reply.extend_from_slice(&r);
    reply.extend_from_slice(&nc);
    reply.extend_from_slice(&mac(
        token,
        &[b"client", &[purpose as u8], &hello[7..23], &r],
    ));
    s.write_all(&reply).map_err(io("handshake", &peer))?;
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).map_err(|_| {
        Error::config(format!(
            "{peer} closed the connection during the handshake: the job tokens differ"
        ))
    })?;
    if proof != mac(token, &[b"server", &[purpose as u8], &nc, &r]) {
        return Err(Error::config(format!("{peer} failed the job-token check")));
    }
    Ok(())
}

/// Log a rejected connection (stderr): the job goes on.
pub(crate) fn log_rejected(what: &str, e: &Error) {
    eprintln!("tutti: rejected a {what} connection: {e}");
}
