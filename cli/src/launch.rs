//! `tutti launch`: start the processes of a job on this host (and, with `--nnodes`, this host's
//! share of a job over several hosts, each running its own launcher, as torchrun does).
//!
//! Each process gets the job's environment: `TUTTI_RANK`, `TUTTI_WORLD_SIZE`, `TUTTI_LOCAL_RANK`,
//! `TUTTI_LOCAL_WORLD_SIZE`, `TUTTI_MASTER_ADDR` (a loopback port chosen by the OS) and a fresh
//! random `TUTTI_JOB_TOKEN`; or, with workers and parameter servers, a `TF_CONFIG` naming every
//! task (with ps tasks comes a chief task, the coordinator parameter-server training needs).
//! The launcher chooses those ports by binding them and never releases them: the process that
//! listens at an address (rank 0 at `TUTTI_MASTER_ADDR`, each task at its own) inherits the
//! bound socket, its descriptor in `TUTTI_LISTEN_FD`, and tutti takes it instead of binding
//! anew, so no other process can take a port between the choice and its use.
//! Output passes through untagged, as mpirun and torchrun pass it; `--tag-output` prefixes every
//! line with its rank (or task). When a process fails, the others are stopped (SIGTERM, then
//! SIGKILL after a grace period), every process that failed is named with its exit status or
//! signal, and the launch fails with the status of the one that failed first (a process killed
//! by a signal before the peers that saw it go). With `--elastic` a failed process stops nobody
//! (the others may shrink their communicators and go on) and the launch succeeds when at least
//! one process succeeded.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use tutti::random_token;
/// The variable that names the inherited listening socket (read by the library).
const LISTEN_FD_VAR: &str = "TUTTI_LISTEN_FD";
use tutti::TransportKind;
use tutti::{Error, Result};

/// What to start.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    /// Number of processes (ranks), when no task lists are given.
    pub nprocs: usize,
    /// Worker tasks (TF_CONFIG mode).
    pub workers: Option<usize>,
    /// Parameter-server tasks (TF_CONFIG mode).
    pub ps: usize,
    /// Transport for every process (`TUTTI_TRANSPORT`).
    pub transport: Option<TransportKind>,
    /// The program and its arguments. `tutti` means this very executable.
    pub program: Vec<OsString>,
    /// Time a stopped process gets between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Prefix every line of output with the process's rank or task.
    pub tag: bool,
    /// Hosts (nodes) of the job, each running its own `tutti launch` (torchrun's `--nnodes`).
    pub nnodes: usize,
    /// This host's index among them (`--node-rank`).
    pub node_rank: usize,
    /// Where rank 0 serves the rendezvous (`--master-addr`, `--master-port`): required with
    /// several hosts; on one host a free loopback port by default.
    pub master: Option<(String, u16)>,
    /// A failed process does not stop the others; the launch succeeds when one succeeded.
    pub elastic: bool,
}

/// `n` listeners on distinct free loopback ports, with their addresses. The launcher holds
/// them until it hands each to its process: a port chosen is never free again.
fn bound_ports(n: usize) -> Result<Vec<(TcpListener, String)>> {
    let io = |e| Error::io("choosing a port", e);
    (0..n)
        .map(|_| {
            let l = TcpListener::bind("127.0.0.1:0").map_err(io)?;
            let addr = l.local_addr().map_err(io)?.to_string();
            Ok((l, addr))
        })
        .collect()
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}{}", signal_name(s)),
        _ => "ended with an unknown status".into(),
    }
}

/// " (SIGKILL)" for the signals users meet, else nothing.
fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => " (SIGHUP)",
        libc::SIGINT => " (SIGINT)",
        libc::SIGQUIT => " (SIGQUIT)",
        libc::SIGILL => " (SIGILL)",
        libc::SIGABRT => " (SIGABRT)",
        libc::SIGBUS => " (SIGBUS)",
        libc::SIGFPE => " (SIGFPE)",
        libc::SIGKILL => " (SIGKILL)",
        libc::SIGSEGV => " (SIGSEGV)",
        libc::SIGPIPE => " (SIGPIPE)",
        libc::SIGTERM => " (SIGTERM)",
        _ => "",
    }
}

/// How a process is named in messages: `rank 3`, `worker 1`, `chief 0`.
fn who(label: &str) -> String {
    match label.split_once(':') {
        Some((task, i)) => format!("{task} {i}"),
        None => format!("rank {label}"),
    }
}

/// Of the processes found failed in one look, the one to blame first: one killed by a signal
/// (a crash, an OOM kill, a kill -9) before one that exited with an error after seeing it.
fn root_cause(failed: &[(String, ExitStatus)]) -> Option<&(String, ExitStatus)> {
    use std::os::unix::process::ExitStatusExt;
    failed
        .iter()
        .find(|(_, s)| s.signal().is_some())
        .or(failed.first())
}

fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
        .max(1)
}

/// A process to start: its label (rank or task), its environment, and the socket bound to the
/// address it listens at, when the launcher chose that address.
type Plan = (String, Vec<(String, String)>, Option<TcpListener>);

/// The environment of each process, with its label.
fn plan(l: &Launch) -> Result<Vec<Plan>> {
    if l.transport == Some(TransportKind::Mpi) {
        return Err(Error::config(
            "--transport mpi: an MPI job is started by an MPI launcher (mpirun -np N \
             tutti perf --transport mpi), not by tutti launch",
        ));
    }
    let token = random_token()?;
    let transport = l
        .transport
        .map(|t| ("TUTTI_TRANSPORT".to_string(), t.to_string()));
    let mut out = Vec::new();
    if let Some(workers) = l.workers {
        if workers == 0 {
            return Err(Error::config("--workers must be at least 1"));
        }
        // Parameter-server training needs a coordinator: with ps tasks comes a chief.
        let chiefs = usize::from(l.ps > 0);
        let mut ports = bound_ports(chiefs + workers + l.ps)?.into_iter();
        let mut tasks = Vec::new();
        for (ty, n) in [("chief", chiefs), ("worker", workers), ("ps", l.ps)] {
            for (i, (listener, addr)) in (0..n).zip(ports.by_ref()) {
                tasks.push((ty, i, addr, listener));
            }
        }
        let list = |ty: &str| {
            tasks
                .iter()
                .filter(|t| t.0 == ty)
                .map(|t| t.2.clone())
                .collect::<Vec<_>>()
        };
        let mut cluster = serde_json::json!({ "worker": list("worker") });
        if chiefs > 0 {
            cluster["chief"] = serde_json::json!(list("chief"));
        }
        if l.ps > 0 {
            cluster["ps"] = serde_json::json!(list("ps"));
        }
        for (ty, i, _, listener) in tasks {
            let tf = serde_json::json!({ "cluster": cluster, "task": { "type": ty, "index": i } });
            let mut env = vec![
                ("TF_CONFIG".to_string(), tf.to_string()),
                ("TUTTI_JOB_TOKEN".to_string(), token.clone()),
            ];
            env.extend(transport.clone());
            out.push((format!("{ty}:{i}"), env, Some(listener)));
        }
    } else {
        if l.nprocs == 0 {
            return Err(Error::config("-n must be at least 1"));
        }
        if l.nnodes == 0 || l.node_rank >= l.nnodes {
            return Err(Error::config(format!(
                "--node-rank {} is out of range for --nnodes {}",
                l.node_rank, l.nnodes
            )));
        }
        let world = l
            .nprocs
            .checked_mul(l.nnodes)
            .ok_or_else(|| Error::config("-n × --nnodes is more processes than can be counted"))?;
        // The rendezvous socket, bound here when the launcher chooses its port (rank 0's).
        let mut rendezvous = None;
        let master = match &l.master {
            Some((host, port)) if host.contains(':') => format!("[{host}]:{port}"),
            Some((host, port)) => format!("{host}:{port}"),
            None if l.nnodes > 1 => {
                return Err(Error::config(
                    "--nnodes above 1 needs --master-addr and --master-port: where rank 0 (on \
                     --node-rank 0) serves the rendezvous, the same on every host",
                ))
            }
            None => {
                let (listener, addr) = bound_ports(1)?.remove(0);
                rendezvous = Some(listener);
                addr
            }
        };
        // Every host's launcher must hand its ranks the same secret: one made here would
        // differ from the others'.
        let token = if l.nnodes > 1 {
            std::env::var("TUTTI_JOB_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
                .ok_or_else(|| {
                    Error::config(
                        "--nnodes above 1 needs the job's secret in TUTTI_JOB_TOKEN, the same \
                         on every host (e.g. export TUTTI_JOB_TOKEN=$(openssl rand -hex 16) \
                         and pass it to each host's launcher)",
                    )
                })?
        } else {
            token
        };
        for local in 0..l.nprocs {
            let r = l.node_rank * l.nprocs + local;
            let mut env: Vec<(String, String)> = [
                ("TUTTI_RANK", r.to_string()),
                ("TUTTI_WORLD_SIZE", world.to_string()),
                ("TUTTI_LOCAL_RANK", local.to_string()),
                ("TUTTI_LOCAL_WORLD_SIZE", l.nprocs.to_string()),
                ("TUTTI_MASTER_ADDR", master.clone()),
                ("TUTTI_JOB_TOKEN", token.clone()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            env.extend(transport.clone());
            let listener = if r == 0 { rendezvous.take() } else { None };
            out.push((r.to_string(), env, listener));
        }
    }
    Ok(out)
}

fn relay(
    label: Option<String>,
    from: impl std::io::Read + Send + 'static,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let tag = label.map_or(String::new(), |l| format!("[{l}] "));
        for line in BufReader::new(from).split(b'\n') {
            let Ok(line) = line else { break };
            let line = String::from_utf8_lossy(&line);
            let r = if to_stderr {
                writeln!(std::io::stderr().lock(), "{tag}{line}")
            } else {
                writeln!(std::io::stdout().lock(), "{tag}{line}")
            };
            if r.is_err() {
                // The reader went away (`| head`): drain quietly so the process is not blocked.
                continue;
            }
        }
    })
}

/// Signal a child's whole process group (it leads one), so its own children stop too.
fn signal(c: &Child, sig: libc::c_int) {
    // SAFETY: signalling a process group we created and have not reaped.
    unsafe { libc::kill(-(c.id() as libc::pid_t), sig) };
}

/// How long the other processes of a failed job may take to end on their own (at most the
/// grace period) before the launcher stops them.
const SETTLE: Duration = Duration::from_secs(2);

/// A signal the launcher received (SIGINT, SIGTERM), forwarded to every process.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    RECEIVED.store(sig, Ordering::SeqCst);
}

fn terminate(children: &mut [(String, Child, Option<ExitStatus>)], grace: Duration) {
    for (_, c, st) in children.iter_mut() {
        if st.is_none() {
            signal(c, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline
        && children
            .iter_mut()
            .any(|(_, c, st)| st.is_none() && c.try_wait().ok().flatten().is_none())
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for (_, c, st) in children.iter_mut() {
        if st.is_none() {
            signal(c, libc::SIGKILL);
        }
    }
}

/// Run the job; the exit code for the launcher (0 when every process succeeded).
pub fn run(l: &Launch) -> Result<i32> {
    let Some(prog) = l.program.first() else {
        return Err(Error::config(
            "no program given (tutti launch -n 2 -- PROGRAM ARGS...)",
        ));
    };
    let exe = if prog == "tutti" {
        std::env::current_exe()
            .map_err(|e| Error::io("locating the tutti executable", e))?
            .into_os_string()
    } else {
        prog.clone()
    };
    let mut children: Vec<(String, Child, Option<ExitStatus>)> = Vec::new();
    let mut relays = Vec::new();
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    for (label, env, listener) in plan(l)? {
        let mut cmd = Command::new(&exe);
        cmd.args(&l.program[1..])
            .envs(env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        // The process inherits the socket bound to its address (every other descriptor of the
        // launcher closes on exec); the launcher's own copy goes once the process has it.
        let inherit = listener.as_ref().map(|l| l.as_raw_fd());
        if let Some(fd) = inherit {
            cmd.env(LISTEN_FD_VAR, fd.to_string());
        }
        // A launcher killed outright (SIGKILL, the OOM killer) cannot stop its processes: the
        // kernel does (this thread, which spawns them, lives as long as the launcher).
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before the line above.
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                if let Some(fd) = inherit {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            })
        };
        let spawned = cmd.spawn();
        drop(listener);
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                terminate(&mut children, l.grace);
                return Err(Error::io(format!("starting {}", exe.to_string_lossy()), e));
            }
        };
        let tag = l.tag.then(|| label.clone());
        relays.push(relay(
            tag.clone(),
            child.stdout.take().expect("piped"),
            false,
        ));
        relays.push(relay(tag, child.stderr.take().expect("piped"), true));
        children.push((label, child, None));
    }
    // The processes lead their own groups (so a stop reaches their children): pass on the
    // launcher's own SIGINT and SIGTERM.
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
    // Every process that failed on its own (not stopped by the launcher), in the order seen.
    let mut failed: Vec<(String, ExitStatus)> = Vec::new();
    let mut stopping = false;
    // A SIGINT or SIGTERM the launcher passed on: the job did not finish.
    let mut interrupted: Option<i32> = None;
    // The failure named when the others were stopped.
    let mut announced: Option<String> = None;
    // When the others are stopped after a failure. The ranks of a failed job usually end
    // within moments on their own (their group is aborted), each saying what it saw: the rank
    // that timed out names the one it waited for. They get that moment before being stopped.
    let mut stop_at: Option<Instant> = None;
    loop {
        let sig = RECEIVED.swap(0, Ordering::SeqCst);
        if sig != 0 && !stopping {
            eprintln!("tutti launch: got signal {sig}; stopping every process");
            interrupted = Some(sig);
            terminate(&mut children, l.grace);
            stopping = true;
        }
        let before = failed.len();
        for (label, c, st) in children.iter_mut().filter(|x| x.2.is_none()) {
            if let Ok(Some(s)) = c.try_wait() {
                *st = Some(s);
                if !s.success() && !stopping {
                    failed.push((label.clone(), s));
                }
            }
        }
        if before == 0 && !failed.is_empty() && !l.elastic {
            stop_at = Some(Instant::now() + l.grace.min(SETTLE));
        }
        if !stopping && stop_at.is_some_and(|t| Instant::now() >= t) {
            let (label, s) = root_cause(&failed).expect("one failed");
            if children.iter().any(|x| x.2.is_none()) {
                // Those still running after the others ended are where to look first (a rank
                // stuck outside its calls, or one that waits for it).
                let running: Vec<String> = (children.iter().filter(|x| x.2.is_none()))
                    .map(|x| who(&x.0))
                    .collect();
                eprintln!(
                    "tutti launch: {} {}; stopping the others (still running: {})",
                    who(label),
                    describe(*s),
                    running.join(", ")
                );
                announced = Some(label.clone());
                terminate(&mut children, l.grace);
                stopping = true;
            }
        }
        if children.iter().all(|x| x.2.is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for r in relays {
        let _ = r.join();
    }
    let first = root_cause(&failed).cloned();
    // Name every process that failed (the first one first), but the one already named.
    if let Some((first_label, _)) = &first {
        let rest = failed.iter().filter(|(l, _)| l != first_label);
        for (label, s) in first.iter().chain(rest) {
            if announced.as_ref() != Some(label) {
                eprintln!("tutti launch: {} {}", who(label), describe(*s));
            }
        }
    }
    // A process killed while it set up shared memory may have left a segment behind.
    tutti::sweep_dead_segments();
    // Elastic: the survivors that finished are the job's result.
    let survived = l.elastic && children.iter().any(|x| x.2.is_some_and(|s| s.success()));
    Ok(match (first, interrupted) {
        (Some(_), None) if survived => {
            eprintln!("tutti launch: the others went on without the failed processes (--elastic) and succeeded");
            0
        }
        (Some((_, s)), _) => exit_code(s),
        (None, Some(sig)) => 128 + sig,
        (None, None) => 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn the_ports_of_a_job_are_distinct() {
        for _ in 0..20 {
            let mut ports: Vec<String> =
                bound_ports(16).unwrap().into_iter().map(|p| p.1).collect();
            ports.sort_unstable();
            ports.dedup();
            assert_eq!(ports.len(), 16, "{ports:?}");
        }
    }

    /// Every address the launcher chooses stays bound from the moment it is chosen until the
    /// process that listens there has the socket: another process that tries to take the port
    /// at any point in between fails (issue 29, item 7). Each such process gets the socket of
    /// its own address, the others none.
    #[test]
    fn a_chosen_port_is_never_free_for_another_process() {
        let ranks = Launch {
            nprocs: 3,
            nnodes: 1,
            ..Launch::default()
        };
        let tasks = Launch {
            workers: Some(2),
            ps: 2,
            ..Launch::default()
        };
        for launch in [ranks, tasks] {
            let plans = plan(&launch).unwrap();
            let mut held = 0;
            for (label, env, listener) in &plans {
                let var = |k: &str| env.iter().find(|e| e.0 == k).map(|e| e.1.clone());
                let own = match var("TF_CONFIG") {
                    Some(tf) => {
                        let tf: serde_json::Value = serde_json::from_str(&tf).unwrap();
                        let (ty, i) = (&tf["task"]["type"], &tf["task"]["index"]);
                        let i = i.as_u64().unwrap() as usize;
                        tf["cluster"][ty.as_str().unwrap()][i]
                            .as_str()
                            .unwrap()
                            .to_string()
                    }
                    None => var("TUTTI_MASTER_ADDR").unwrap(),
                };
                // A squatter that comes right after the choice finds the port taken.
                let e = TcpListener::bind(&own).err();
                assert_eq!(
                    e.map(|e| e.kind()),
                    Some(std::io::ErrorKind::AddrInUse),
                    "{label}: {own} was free"
                );
                match listener {
                    Some(l) => {
                        assert_eq!(l.local_addr().unwrap().to_string(), own, "{label}");
                        held += 1;
                    }
                    None => assert!(label != "0", "rank 0 serves the rendezvous"),
                }
            }
            assert_eq!(held, if launch.workers.is_some() { 5 } else { 1 });
        }
    }

    #[test]
    fn a_process_killed_by_a_signal_is_blamed_before_those_that_exited() {
        let exited = ExitStatus::from_raw(1 << 8);
        let killed = ExitStatus::from_raw(libc::SIGKILL);
        let seen = vec![
            ("0".to_string(), exited),
            ("3".to_string(), killed),
            ("1".to_string(), exited),
        ];
        let (label, status) = root_cause(&seen).unwrap();
        assert_eq!(label, "3");
        assert_eq!(describe(*status), "was killed by signal 9 (SIGKILL)");
        assert_eq!(exit_code(*status), 137);
        assert_eq!(describe(exited), "exited with status 1");
        assert_eq!(root_cause(&seen[..1]).unwrap().0, "0");
        assert_eq!(who("3"), "rank 3");
        assert_eq!(who("worker:1"), "worker 1");
    }
}
