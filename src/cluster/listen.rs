//! Listening sockets a launcher binds for its processes.
//!
//! `tutti launch` chooses the addresses of a job (the rendezvous port, each TF_CONFIG task's
//! port) by binding them, and never lets go: each process inherits the socket bound to its own
//! address, its descriptor named by `TUTTI_LISTEN_FD`. Whatever in this process listens at that
//! address ([`bind`]: the rendezvous store, a parameter-server task) takes that socket instead
//! of binding anew, so no other process can take the port between the launcher's choice and
//! the listener.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{FromRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// The variable naming the descriptor of the listening socket a launcher handed this process.
pub const LISTEN_FD_VAR: &str = "TUTTI_LISTEN_FD";

/// Connections a listener queues before it accepts them. A job's ranks connect at once: past
/// the 128 that a plain bind asks for, the kernel drops a connection's first packet and the
/// rank waits a second for its retry (256 ranks took 24 s to meet). The kernel holds it to
/// `net.core.somaxconn`.
pub(crate) const BACKLOG: libc::c_int = 4096;

/// A new TCP listener on the first of `addr`'s addresses that binds, queueing [`BACKLOG`]
/// connections (address reuse on, close-on-exec, as a plain bind).
pub(crate) fn listen_tcp<A: ToSocketAddrs>(addr: A) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        let attempt = (|| {
            let s = socket2::Socket::new(
                socket2::Domain::for_address(a),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            s.set_reuse_address(true)?;
            s.bind(&a.into())?;
            s.listen(BACKLOG)?;
            Ok(TcpListener::from(s))
        })();
        match attempt {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolves to nothing",
        )
    }))
}

/// A listener on `addr`: the inherited socket (see the module documentation) when it is bound
/// to exactly that address, taken once; otherwise a new one.
pub(crate) fn bind<A: ToSocketAddrs>(addr: A) -> std::io::Result<TcpListener> {
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    if !TAKEN.load(Ordering::Acquire) {
        let fd = std::env::var(LISTEN_FD_VAR)
            .ok()
            .and_then(|v| v.trim().parse::<RawFd>().ok());
        if let Some(fd) = fd.filter(|&fd| listening_at(fd, &addrs)) {
            if !TAKEN.swap(true, Ordering::AcqRel) {
                return Ok(adopt(fd));
            }
        }
    }
    listen_tcp(&addrs[..])
}

/// Whether `fd` is a listening TCP socket bound to one of `addrs` (never port 0: that asks for
/// a fresh port). Reads the descriptor's state only: one that is something else is left alone.
fn listening_at(fd: RawFd, addrs: &[SocketAddr]) -> bool {
    if fd <= 2 {
        return false;
    }
    let opt = |name: libc::c_int| -> Option<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`; a descriptor that is no
        // socket is an error, not undefined behaviour.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (r == 0).then_some(v)
    };
    if opt(libc::SO_ACCEPTCONN) != Some(1) || opt(libc::SO_TYPE) != Some(libc::SOCK_STREAM) {
        return false;
    }
    // Borrow the descriptor to read its address, without taking it.
    // SAFETY: `fd` is an open socket (getsockopt succeeded); ManuallyDrop never closes it.
    let borrowed = std::mem::ManuallyDrop::new(unsafe { TcpListener::from_raw_fd(fd) });
    match borrowed.local_addr() {
        Ok(local) => local.port() != 0 && addrs.contains(&local),
        Err(_) => false,
    }
}

/// Own the inherited socket; it is not passed on to this process's own children.
fn adopt(fd: RawFd) -> TcpListener {
    // SAFETY: a descriptor inherited for this purpose alone, checked by `listening_at`, and
    // taken once (the caller's flag).
    unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        // The launcher's bind queued 128: listening again takes the longer queue.
        libc::listen(fd, BACKLOG);
        TcpListener::from_raw_fd(fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, IntoRawFd};

    #[test]
    fn a_listener_queues_a_whole_job_connecting_at_once() {
        // 300 connections before any accept: past a queue of 128 the kernel drops the first
        // packet of the rest, whose connect then waits a second for its retry. The kernel holds
        // the queue to net.core.somaxconn (4096 from Linux 5.4; 128 before).
        let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if somaxconn < 300 {
            eprintln!("skipped: net.core.somaxconn is {somaxconn}, below the 300 this test queues");
            return;
        }
        let l = listen_tcp("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let queued: Vec<_> = (0..300)
            .map(|i| {
                std::net::TcpStream::connect_timeout(&at, std::time::Duration::from_millis(500))
                    .unwrap_or_else(|e| panic!("connection {i} was not queued: {e}"))
            })
            .collect();
        let mut accepted = 0;
        l.set_nonblocking(true).unwrap();
        while l.accept().is_ok() {
            accepted += 1;
        }
        assert_eq!(accepted, queued.len());
    }

    #[test]
    fn only_a_listening_socket_at_the_address_is_taken() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let fd = l.as_raw_fd();
        assert!(listening_at(fd, &[at]));
        let elsewhere: SocketAddr = format!("127.0.0.1:{}", at.port().wrapping_add(1))
            .parse()
            .unwrap();
        assert!(!listening_at(fd, &[elsewhere]));
        let file = std::fs::File::open("/dev/null").unwrap();
        assert!(!listening_at(file.as_raw_fd(), &[at]));
        let connected = std::net::TcpStream::connect(at).unwrap();
        assert!(!listening_at(connected.as_raw_fd(), &[at]));
        assert!(!listening_at(-1, &[at]));
        // Taken, it is the same socket: what connects to the address reaches it.
        let taken = adopt(l.into_raw_fd());
        assert_eq!(taken.local_addr().unwrap(), at);
        let _c = std::net::TcpStream::connect(at).unwrap();
        taken.accept().unwrap();
    }
}

/// `TUTTI_LISTEN_FD` is the environment's: any descriptor number and address is looked at
/// without a panic, and nothing but a listening socket at that very address is taken.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_descriptor_is_looked_at_safely(fd in -4i32..2048, port in any::<u16>()) {
            let at: SocketAddr = ([127, 0, 0, 1], port).into();
            // Only reads the descriptor's state; a match needs a listener at that address.
            let _ = listening_at(fd, &[at]);
            prop_assert!(!listening_at(fd, &[([127, 0, 0, 1], 0).into()]));
        }
    }
}
