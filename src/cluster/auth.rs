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

/// Log a rejected connection (a warning): the job goes on.
pub(crate) fn log_rejected(what: &str, e: &Error) {
    log::warn!("rejected a {what} connection: {e}");
}

/// Where this user's job secret lives: `$XDG_RUNTIME_DIR/tutti/secret` (a directory only the
/// user can enter), else `$HOME/.cache/tutti/secret`, else `/tmp/tutti-UID/secret`.
fn secret_path(vars: &std::collections::HashMap<String, String>) -> std::path::PathBuf {
    use std::path::PathBuf;
    let var = |k: &str| vars.get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("XDG_RUNTIME_DIR").filter(|d| d.is_dir()) {
        return d.join("tutti").join("secret");
    }
    if let Some(h) = var("HOME").filter(|h| h.is_dir()) {
        return h.join(".cache").join("tutti").join("secret");
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/tutti-{uid}")).join("secret")
}

/// The secret of jobs that set none, on one host: a random token in a file only this user can
/// read (created once, atomically, mode 0600, in a directory of mode 0700 that this user owns).
/// Another user cannot read it, so cannot join; this user's own processes share it.
pub(crate) fn user_secret(vars: &std::collections::HashMap<String, String>) -> Result<String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    let path = secret_path(vars);
    let dir = path.parent().expect("a file in a directory");
    let fail = |what: &str, e: std::io::Error| {
        Error::io(
            format!(
                "the per-user job secret {} ({what}; set TUTTI_JOB_TOKEN to give the job a \
                 secret yourself)",
                path.display()
            ),
            e,
        )
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| fail("creating its directory", e))?;
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let safe = |p: &std::path::Path| -> Result<()> {
        let m = std::fs::symlink_metadata(p).map_err(|e| fail("reading its permissions", e))?;
        if m.uid() != uid || m.permissions().mode() & 0o077 != 0 || m.file_type().is_symlink() {
            return Err(Error::config(format!(
                "the per-user job secret: {} is not private to this user (owner {}, mode {:o}); \
                 remove it, or set TUTTI_JOB_TOKEN",
                p.display(),
                m.uid(),
                m.permissions().mode() & 0o777
            )));
        }
        Ok(())
    };
    safe(dir)?;
    if !path.exists() {
        // Write a fresh secret under a temporary name, then link it into place: of two
        // processes racing here, one link wins and both read the winner's secret.
        // Unique per attempt: threads of one process may race here too (ranks joining at once).
        let token = random_token()?;
        let tmp = dir.join(format!("secret.{}.{}.tmp", std::process::id(), &token[..8]));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| fail("creating it", e))?;
        f.write_all(token.as_bytes())
            .map_err(|e| fail("writing it", e))?;
        drop(f);
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(fail("creating it", e)),
        }
    }
    safe(&path)?;
    let token = std::fs::read_to_string(&path).map_err(|e| fail("reading it", e))?;
    let token = token.trim().to_string();
    if token.len() < 16 {
        return Err(Error::config(format!(
            "the per-user job secret {} holds fewer than 16 characters; remove it, or set \
             TUTTI_JOB_TOKEN",
            path.display()
        )));
    }
    Ok(token)
}
