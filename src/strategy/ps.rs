//! ParameterServerStrategy: variables sharded across `ps` tasks, workers that pull variables and
//! push gradients asynchronously, and a coordinator (the chief) that schedules steps on workers.
//!
//! Every task of the TF_CONFIG cluster calls [`ParameterServerStrategy::run_role`] with the same
//! step function. A `ps` task serves its shards until the coordinator shuts the job down; a
//! `worker` runs the steps it is sent (pull every variable, call the step function, push the
//! gradients, answer with the loss); the `chief` gets a [`Coordinator`]. The coordinator places
//! each variable's shards on the ps tasks ([`Partitioner`]), hands steps to workers as they become
//! free, and when a worker is lost (its connection breaks or a step outlives the timeout) gives
//! that step to another worker. A rescheduled step may apply its gradient twice, as in
//! TensorFlow: delivery is at least once. A step whose step function fails is the caller's
//! error (the worker stays in the job); a lost ps task ends the job on every task, each naming
//! it.
//!
//! Updates are plain SGD applied by the ps task on each push: `w -= lr * g`.
//! Every connection proves the job token (the same handshake as the collectives).

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::cluster::auth::{handshake_client, handshake_server, log_rejected, Purpose};
use crate::cluster::{split_addr, ClusterSpec};
use crate::error::{Error, Result};

/// How a variable is cut into shards across the ps tasks.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Partitioner {
    /// At most this many shards (and no more than there are ps tasks or elements).
    MaxShards(usize),
    /// Shards of at least this many bytes (TensorFlow's `MinSizePartitioner`).
    MinShardBytes(usize),
}

impl Partitioner {
    /// Shard count for a variable of `len` f32 elements over `ps` tasks.
    pub fn shards(self, len: usize, ps: usize) -> usize {
        let n = match self {
            Partitioner::MaxShards(k) => k,
            Partitioner::MinShardBytes(b) => (len * 4) / b.max(1),
        };
        n.clamp(1, ps.max(1)).min(len.max(1))
    }
}

const OP_CREATE: u32 = 1;
const OP_PULL: u32 = 2;
const OP_PUSH: u32 = 3;
const OP_SETUP: u32 = 4;
const OP_STEP: u32 = 5;
const OP_SHUTDOWN: u32 = 6;
/// The job is over because a task was lost (payload: [`encode_lost`]); the task that gets it
/// returns that error from `run_role`.
const OP_ABORT: u32 = 7;
const OP_OK: u32 = 100;
const OP_ERR: u32 = 101;
/// A worker's answer to a step whose step function failed (payload: its message). The worker
/// stays in the job.
const OP_STEP_FAILED: u32 = 102;
/// A worker's answer to a step it could not run because a ps task is gone (payload:
/// [`encode_lost`]). The worker leaves the job with that error.
const OP_TASK_LOST: u32 = 103;

fn send(s: &mut TcpStream, op: u32, payload: &[u8]) -> std::io::Result<()> {
    let mut m = Vec::with_capacity(12 + payload.len());
    m.extend_from_slice(&op.to_le_bytes());
    m.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    m.extend_from_slice(payload);
    s.write_all(&m)
}

fn recv(s: &mut TcpStream) -> std::io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; 12];
    s.read_exact(&mut h)?;
    let op = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(h[4..].try_into().expect("8 bytes"));
    if len > 1 << 32 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "message too large",
        ));
    }
    let mut p = vec![0u8; len as usize];
    s.read_exact(&mut p)?;
    Ok((op, p))
}

/// Request and answer. A broken connection (or no answer within the timeout) is
/// [`Error::TaskLost`] naming `who`.
fn exchange(s: &mut TcpStream, op: u32, payload: &[u8], who: &str) -> Result<(u32, Vec<u8>)> {
    let lost = |e: std::io::Error| Error::TaskLost {
        task: who.to_string(),
        detail: e.to_string(),
    };
    send(s, op, payload).map_err(lost)?;
    recv(s).map_err(lost)
}

/// Request and answer; an `OP_ERR` answer becomes an error carrying the peer's message.
fn call(s: &mut TcpStream, op: u32, payload: &[u8], who: &str) -> Result<Vec<u8>> {
    match exchange(s, op, payload, who)? {
        (OP_OK, p) => Ok(p),
        (OP_TASK_LOST, p) => Err(decode_lost(&p)),
        (_, p) => Err(Error::System {
            what: who.to_string(),
            message: String::from_utf8_lossy(&p).into_owned(),
        }),
    }
}

/// A lost task's error as it travels between tasks: the task's name, a newline, the detail.
fn encode_lost(e: &Error) -> Vec<u8> {
    match e {
        Error::TaskLost { task, detail } => format!("{task}\n{detail}").into_bytes(),
        other => format!("a task\n{other}").into_bytes(),
    }
}

fn decode_lost(p: &[u8]) -> Error {
    let text = String::from_utf8_lossy(p);
    let (task, detail) = text.split_once('\n').unwrap_or(("a task", &text));
    Error::TaskLost {
        task: task.to_string(),
        detail: detail.to_string(),
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    b.get(i * 4..i * 4 + 4)
        .map_or(0, |c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
}

/// Where one shard lives.
#[derive(Clone, Debug)]
struct Shard {
    ps: usize,
    var: u32,
    index: u32,
    len: usize,
}

/// What a worker's step function sees.
pub struct StepContext {
    step: u64,
    worker: usize,
    num_workers: usize,
    variables: Vec<Vec<f32>>,
}

impl StepContext {
    /// The step number the coordinator scheduled.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// This worker's index.
    pub fn worker(&self) -> usize {
        self.worker
    }
    /// Workers in the job.
    pub fn num_workers(&self) -> usize {
        self.num_workers
    }
    /// Every variable's current value, in creation order.
    pub fn variables(&self) -> &[Vec<f32>] {
        &self.variables
    }
}

/// A worker's step: one gradient per variable, and the loss.
pub type StepResult = Result<(Vec<Vec<f32>>, f32)>;

/// What [`ParameterServerStrategy::run_role`] leaves this process to do.
pub enum Role {
    /// This is the chief: drive the training.
    Chief(Coordinator),
    /// A ps or worker task whose job has been shut down by the coordinator.
    Done,
}

/// The strategy. See the module docs.
pub struct ParameterServerStrategy {
    spec: ClusterSpec,
    partitioner: Partitioner,
    timeout: Duration,
    /// The job's secret ([`ClusterSpec::job_key`]).
    key: String,
}

impl ParameterServerStrategy {
    /// From this process's TF_CONFIG (it needs `chief`, `worker` and `ps` tasks).
    pub fn from_env(partitioner: Partitioner) -> Result<ParameterServerStrategy> {
        let spec = ClusterSpec::from_env()?
            .ok_or_else(|| Error::config("ParameterServerStrategy: no cluster (set TF_CONFIG or run under tutti launch --workers N --ps M)"))?;
        ParameterServerStrategy::new(spec, partitioner)
    }

    /// From a cluster spec. The job's secret is decided here, by the rule of every way of
    /// joining ([`ClusterSpec::job_key`]): a spec without a token across hosts is refused
    /// (unless `TUTTI_INSECURE=1`).
    pub fn new(spec: ClusterSpec, partitioner: Partitioner) -> Result<ParameterServerStrategy> {
        for ty in ["chief", "worker", "ps"] {
            if spec.cluster.get(ty).is_none_or(|l| l.is_empty()) {
                return Err(Error::config(format!(
                    "ParameterServerStrategy: the cluster has no '{ty}' task (it needs a chief, workers and ps tasks)"
                )));
            }
        }
        let key = spec.job_key()?;
        Ok(ParameterServerStrategy {
            spec,
            partitioner,
            timeout: crate::sync::default_timeout(),
            key,
        })
    }

    /// Set the bound on every wait (default: the communicator default).
    pub fn with_timeout(mut self, timeout: Duration) -> ParameterServerStrategy {
        self.timeout = timeout;
        self
    }

    /// Workers in the job.
    pub fn num_workers(&self) -> usize {
        self.spec.cluster["worker"].len()
    }

    fn token(&self) -> String {
        self.key.clone()
    }

    /// Take this task's role: serve (ps), run steps with `step_fn` (worker), or coordinate
    /// (chief). Servers return `Role::Done` once the coordinator shuts the job down.
    pub fn run_role<F>(&self, step_fn: F) -> Result<Role>
    where
        F: Fn(&StepContext) -> StepResult + Send + Sync + 'static,
    {
        let own = self.spec.cluster[&self.spec.task_type][self.spec.task_index].clone();
        match self.spec.task_type.as_str() {
            "chief" => Ok(Role::Chief(Coordinator::connect(self)?)),
            "ps" => serve(
                &own,
                &self.token(),
                self.timeout,
                Arc::new(PsState::default()),
                None,
            )
            .map(|_| Role::Done),
            "worker" => {
                let w = WorkerState {
                    index: self.spec.task_index,
                    num_workers: self.num_workers(),
                    ps: self.spec.cluster["ps"].clone(),
                    token: self.token(),
                    timeout: self.timeout,
                    layout: Mutex::new(Vec::new()),
                    conns: Mutex::new(HashMap::new()),
                    step_fn: Box::new(step_fn),
                };
                serve(
                    &own,
                    &self.token(),
                    self.timeout,
                    Arc::new(PsState::default()),
                    Some(Arc::new(w)),
                )
                .map(|_| Role::Done)
            }
            other => Err(Error::config(format!(
                "ParameterServerStrategy: task type '{other}' has no role"
            ))),
        }
    }
}

/// A shard held by a ps task: its values and learning rate.
type HeldShard = (Vec<f32>, f32);

/// A ps task's shards by (variable, shard), and why the task's job ended early, if it did.
#[derive(Default)]
struct PsState {
    shards: Mutex<HashMap<(u32, u32), HeldShard>>,
    /// A lost task that ended this task's part of the job: `serve` returns it.
    failure: Mutex<Option<Error>>,
}

struct WorkerState {
    index: usize,
    num_workers: usize,
    ps: Vec<String>,
    token: String,
    timeout: Duration,
    layout: Mutex<Vec<Vec<Shard>>>,
    conns: Mutex<HashMap<usize, TcpStream>>,
    step_fn: Box<dyn Fn(&StepContext) -> StepResult + Send + Sync>,
}

fn connect(addr: &str, token: &str, timeout: Duration) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    loop {
        let attempt = (|| -> Result<TcpStream> {
            let sa = addr
                .to_socket_addrs()
                .map_err(|e| Error::io(format!("resolving {addr}"), e))?
                .next()
                .ok_or_else(|| Error::config(format!("{addr} resolves to nothing")))?;
            let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(5))
                .map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
            handshake_client(
                &mut s,
                token,
                Purpose::Data,
                u32::MAX,
                Duration::from_secs(10),
            )?;
            s.set_read_timeout(Some(timeout))
                .map_err(|e| Error::io("configuring a connection", e))?;
            let _ = s.set_nodelay(true);
            Ok(s)
        })();
        match attempt {
            Ok(s) => return Ok(s),
            Err(e @ Error::InvalidArgument { .. }) => return Err(e),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Serve connections on `addr` until a SHUTDOWN arrives (or no one connects within `timeout`).
fn serve(
    addr: &str,
    token: &str,
    timeout: Duration,
    ps: Arc<PsState>,
    worker: Option<Arc<WorkerState>>,
) -> Result<()> {
    let (host, port) = split_addr(addr, "ParameterServerStrategy task address")?;
    let listener = crate::cluster::listen::bind((host.as_str(), port))
        .map_err(|e| Error::io(format!("listening on {addr}"), e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("listening", e))?;
    let done = Arc::new(AtomicBool::new(false));
    let mut last = Instant::now();
    let mut handlers = Vec::new();
    while !done.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((mut s, _)) => {
                last = Instant::now();
                let (ps, worker, done, token) =
                    (ps.clone(), worker.clone(), done.clone(), token.to_string());
                handlers.push(std::thread::spawn(move || {
                    let _ = s.set_nonblocking(false);
                    if let Err(e) =
                        handshake_server(&mut s, &token, Purpose::Data, Duration::from_secs(10))
                    {
                        log_rejected("parameter-server", &e);
                        return;
                    }
                    let _ = s.set_read_timeout(None);
                    let _ = s.set_nodelay(true);
                    handle(&mut s, &ps, worker.as_deref(), &done);
                }));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let before = handlers.len();
                handlers.retain(|h| !h.is_finished());
                if before > 0 && handlers.is_empty() {
                    last = Instant::now();
                }
                if handlers.is_empty() && last.elapsed() > timeout {
                    return Err(Error::config(format!(
                        "{addr}: no coordinator connected within {timeout:?} (it never came, or went away without shutting the job down)"
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(Error::io("accepting", e)),
        }
    }
    match ps.failure.lock().take() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn handle(s: &mut TcpStream, ps: &PsState, worker: Option<&WorkerState>, done: &AtomicBool) {
    while let Ok((op, p)) = recv(s) {
        let answer = match op {
            OP_SHUTDOWN => {
                done.store(true, Ordering::Release);
                let _ = send(s, OP_OK, &[]);
                return;
            }
            OP_ABORT => {
                *ps.failure.lock() = Some(decode_lost(&p));
                done.store(true, Ordering::Release);
                let _ = send(s, OP_OK, &[]);
                return;
            }
            OP_CREATE => {
                let (var, shard, lr) =
                    (u32_at(&p, 0), u32_at(&p, 1), f32::from_bits(u32_at(&p, 2)));
                ps.shards.lock().insert((var, shard), (f32s(&p[12..]), lr));
                Ok(Vec::new())
            }
            OP_PULL => match ps.shards.lock().get(&(u32_at(&p, 0), u32_at(&p, 1))) {
                Some((v, _)) => Ok(bytes(v)),
                None => Err(format!(
                    "no shard {} of variable {} here",
                    u32_at(&p, 1),
                    u32_at(&p, 0)
                )),
            },
            OP_PUSH => match ps.shards.lock().get_mut(&(u32_at(&p, 0), u32_at(&p, 1))) {
                Some((v, lr)) => {
                    let g = f32s(&p[8..]);
                    if g.len() != v.len() {
                        Err(format!(
                            "gradient of {} elements for a shard of {}",
                            g.len(),
                            v.len()
                        ))
                    } else {
                        v.iter_mut().zip(&g).for_each(|(w, g)| *w -= *lr * g);
                        Ok(Vec::new())
                    }
                }
                None => Err(format!(
                    "no shard {} of variable {} here",
                    u32_at(&p, 1),
                    u32_at(&p, 0)
                )),
            },
            OP_SETUP => match worker {
                Some(w) => {
                    *w.layout.lock() = decode_layout(&p);
                    Ok(Vec::new())
                }
                None => Err("SETUP sent to a ps task".into()),
            },
            OP_STEP => match worker {
                Some(w) => {
                    let step = p.get(..8).and_then(|b| b.try_into().ok());
                    let step = u64::from_le_bytes(step.unwrap_or([0; 8]));
                    match w.step(step) {
                        Ok(b) => Ok(b),
                        Err(e @ Error::TaskLost { .. }) => {
                            // Without that ps task this worker cannot run any step: it leaves
                            // the job with the error, once the coordinator has heard it.
                            let _ = send(s, OP_TASK_LOST, &encode_lost(&e));
                            *ps.failure.lock() = Some(e);
                            done.store(true, Ordering::Release);
                            return;
                        }
                        Err(e) => {
                            // The step's own failure is the user's: it goes back to the
                            // coordinator, and this worker stays in the job.
                            let message = match e {
                                Error::StepFailed { message, .. } => message,
                                e => e.to_string(),
                            };
                            if send(s, OP_STEP_FAILED, message.as_bytes()).is_err() {
                                return;
                            }
                            continue;
                        }
                    }
                }
                None => Err("STEP sent to a ps task".into()),
            },
            other => Err(format!("unknown request {other}")),
        };
        let sent = match answer {
            Ok(b) => send(s, OP_OK, &b),
            Err(m) => send(s, OP_ERR, m.as_bytes()),
        };
        if sent.is_err() {
            return;
        }
    }
}

fn encode_layout(layout: &[Vec<Shard>]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(layout.len() as u32).to_le_bytes());
    for shards in layout {
        b.extend_from_slice(&(shards.len() as u32).to_le_bytes());
        for s in shards {
            for v in [s.ps as u32, s.var, s.index, s.len as u32] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    b
}

fn decode_layout(b: &[u8]) -> Vec<Vec<Shard>> {
    let mut i = 0;
    let mut next = || {
        i += 1;
        u32_at(b, i - 1)
    };
    let vars = next();
    (0..vars)
        .map(|_| {
            let n = next();
            (0..n)
                .map(|_| Shard {
                    ps: next() as usize,
                    var: next(),
                    index: next(),
                    len: next() as usize,
                })
                .collect()
        })
        .collect()
}

impl WorkerState {
    fn with_ps<R>(&self, ps: usize, f: impl FnOnce(&mut TcpStream) -> Result<R>) -> Result<R> {
        let mut conns = self.conns.lock();
        let conn = match conns.entry(ps) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let addr = self
                    .ps
                    .get(ps)
                    .ok_or_else(|| Error::config(format!("no ps task {ps}")))?;
                let conn = connect(addr, &self.token, self.timeout).map_err(|e| match e {
                    e @ Error::InvalidArgument { .. } => e,
                    e => Error::TaskLost {
                        task: format!("ps task {ps}"),
                        detail: format!("not reachable at {addr}: {e}"),
                    },
                })?;
                e.insert(conn)
            }
        };
        let r = f(conn);
        if r.is_err() {
            conns.remove(&ps);
        }
        r
    }

    /// Pull every variable, run the step function, push the gradients; the loss.
    fn step(&self, step: u64) -> Result<Vec<u8>> {
        let layout = self.layout.lock().clone();
        let mut variables = Vec::with_capacity(layout.len());
        for shards in &layout {
            let mut v = Vec::new();
            for s in shards {
                let mut req = s.var.to_le_bytes().to_vec();
                req.extend_from_slice(&s.index.to_le_bytes());
                v.extend(f32s(&self.with_ps(s.ps, |c| {
                    call(c, OP_PULL, &req, &format!("ps task {}", s.ps))
                })?));
            }
            variables.push(v);
        }
        let ctx = StepContext {
            step,
            worker: self.index,
            num_workers: self.num_workers,
            variables,
        };
        let failed = |message: String| Error::StepFailed {
            worker: self.index,
            step,
            message,
        };
        let (grads, loss) = (self.step_fn)(&ctx).map_err(|e| failed(e.to_string()))?;
        if grads.len() != layout.len() {
            return Err(failed(format!(
                "the step returned {} gradients for {} variables",
                grads.len(),
                layout.len()
            )));
        }
        for (g, shards) in grads.iter().zip(&layout) {
            let total: usize = shards.iter().map(|s| s.len).sum();
            if g.len() != total {
                return Err(failed(format!(
                    "a gradient of {} elements for a variable of {total}",
                    g.len()
                )));
            }
            let mut at = 0;
            for s in shards {
                let mut req = s.var.to_le_bytes().to_vec();
                req.extend_from_slice(&s.index.to_le_bytes());
                req.extend(bytes(&g[at..at + s.len]));
                at += s.len;
                self.with_ps(s.ps, |c| {
                    call(c, OP_PUSH, &req, &format!("ps task {}", s.ps))
                })?;
            }
        }
        Ok(loss.to_le_bytes().to_vec())
    }
}

/// A handle on a variable created by the coordinator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct VariableId(usize);

/// The chief's side: creates variables, schedules steps, reads results, shuts the job down.
pub struct Coordinator {
    workers: Vec<Mutex<Option<TcpStream>>>,
    ps: Vec<Mutex<TcpStream>>,
    layout: Mutex<Vec<Vec<Shard>>>,
    partitioner: Partitioner,
}

impl Coordinator {
    fn connect(s: &ParameterServerStrategy) -> Result<Coordinator> {
        let token = s.token();
        let ps = s.spec.cluster["ps"]
            .iter()
            .map(|a| connect(a, &token, s.timeout).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        let workers = s.spec.cluster["worker"]
            .iter()
            .map(|a| connect(a, &token, s.timeout).map(|c| Mutex::new(Some(c))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Coordinator {
            workers,
            ps,
            layout: Mutex::new(Vec::new()),
            partitioner: s.partitioner,
        })
    }

    /// Workers still alive.
    pub fn num_workers(&self) -> usize {
        self.workers.iter().filter(|w| w.lock().is_some()).count()
    }

    /// Create a variable, sharded across the ps tasks by the partitioner, updated with SGD at
    /// learning rate `lr` as gradients arrive.
    pub fn create_variable(&self, name: &str, initial: &[f32], lr: f32) -> Result<VariableId> {
        let mut layout = self.layout.lock();
        let var = layout.len() as u32;
        let n = self.partitioner.shards(initial.len(), self.ps.len());
        let mut shards = Vec::with_capacity(n);
        for i in 0..n {
            let r = crate::algorithm::partition(initial.len(), n, i);
            let ps = (var as usize + i) % self.ps.len();
            let mut req = Vec::new();
            for v in [var, i as u32, lr.to_bits()] {
                req.extend_from_slice(&v.to_le_bytes());
            }
            req.extend(bytes(&initial[r.clone()]));
            call(
                &mut self.ps[ps].lock(),
                OP_CREATE,
                &req,
                &format!("ps task {ps} (creating '{name}')"),
            )?;
            shards.push(Shard {
                ps,
                var,
                index: i as u32,
                len: r.len(),
            });
        }
        layout.push(shards);
        let setup = encode_layout(&layout);
        for (i, w) in self.workers.iter().enumerate() {
            if let Some(c) = w.lock().as_mut() {
                call(c, OP_SETUP, &setup, &format!("worker {i}"))?;
            }
        }
        Ok(VariableId(var as usize))
    }

    /// The shard count of each variable.
    pub fn shards(&self) -> Vec<usize> {
        self.layout.lock().iter().map(|s| s.len()).collect()
    }

    /// Read a variable's current value from its ps tasks.
    pub fn read_variable(&self, id: VariableId) -> Result<Vec<f32>> {
        let layout = self.layout.lock();
        let shards = layout
            .get(id.0)
            .ok_or_else(|| Error::config(format!("no variable {}", id.0)))?;
        let mut v = Vec::new();
        for s in shards {
            let mut req = s.var.to_le_bytes().to_vec();
            req.extend_from_slice(&s.index.to_le_bytes());
            v.extend(f32s(&call(
                &mut self.ps[s.ps].lock(),
                OP_PULL,
                &req,
                &format!("ps task {}", s.ps),
            )?));
        }
        Ok(v)
    }

    /// Run steps `0..n` on the workers, each step on whichever worker is free, and return the
    /// losses in step order.
    ///
    /// - A worker that is lost (its connection breaks, or a step outlives the timeout) is
    ///   dropped and its step given to another; the call fails only when every worker is lost.
    /// - A step whose step function fails is the caller's error: no further step is
    ///   scheduled, the steps already running finish, and the call returns
    ///   [`Error::StepFailed`] with the step function's message and the worker that raised it.
    ///   The workers stay in the job: the next `run_steps` uses them all.
    /// - A ps task that is gone ends the job: every task still reachable is told, each
    ///   returns [`Error::TaskLost`] naming it from `run_role`, and so does this call.
    pub fn run_steps(&self, n: usize) -> Result<Vec<f32>> {
        let queue = Mutex::new((0..n as u64).collect::<VecDeque<u64>>());
        let losses = Mutex::new(vec![f32::NAN; n]);
        let remaining = std::sync::atomic::AtomicUsize::new(n);
        let lost = Mutex::new(Vec::new());
        // The first step failure or lost ps task; once set, no step is handed out.
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let stop = AtomicBool::new(false);
        std::thread::scope(|sc| {
            for (i, w) in self.workers.iter().enumerate() {
                let (queue, losses, remaining, lost, failure, stop) =
                    (&queue, &losses, &remaining, &lost, &failure, &stop);
                sc.spawn(move || {
                    let mut conn = w.lock();
                    let fail = |e: Error| {
                        let mut f = failure.lock();
                        match &*f {
                            None => *f = Some(e),
                            Some(_) => log::warn!("parameter-server job: also {e}"),
                        }
                        stop.store(true, Ordering::Release);
                    };
                    while remaining.load(Ordering::Acquire) > 0 && !stop.load(Ordering::Acquire) {
                        let Some(c) = conn.as_mut() else { return };
                        let Some(step) = queue.lock().pop_front() else {
                            std::thread::sleep(Duration::from_millis(1));
                            continue;
                        };
                        let who = format!("worker {i}");
                        match exchange(c, OP_STEP, &step.to_le_bytes(), &who) {
                            Ok((OP_OK, b)) => {
                                let loss = b.get(..4).and_then(|b| b.try_into().ok());
                                losses.lock()[step as usize] =
                                    f32::from_le_bytes(loss.unwrap_or([0; 4]));
                                remaining.fetch_sub(1, Ordering::AcqRel);
                            }
                            Ok((OP_STEP_FAILED, m)) => fail(Error::StepFailed {
                                worker: i,
                                step,
                                message: String::from_utf8_lossy(&m).into_owned(),
                            }),
                            Ok((OP_TASK_LOST, m)) => {
                                // The worker left the job with this error.
                                *conn = None;
                                fail(decode_lost(&m));
                                return;
                            }
                            Ok((_, m)) => fail(Error::System {
                                what: format!("worker {i} refused step {step}"),
                                message: String::from_utf8_lossy(&m).into_owned(),
                            }),
                            Err(e) => {
                                log::warn!(
                                    "worker {i} lost during step {step} ({e}); rescheduling the step"
                                );
                                queue.lock().push_front(step);
                                lost.lock().push((i, e));
                                *conn = None;
                                return;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = failure.into_inner() {
            if matches!(e, Error::TaskLost { .. }) {
                self.abort(&e);
            }
            return Err(e);
        }
        let left = remaining.load(Ordering::Acquire);
        if left > 0 {
            let why: Vec<String> = lost
                .into_inner()
                .iter()
                .map(|(i, e)| format!("worker {i}: {e}"))
                .collect();
            return Err(Error::TaskLost {
                task: "every worker".into(),
                detail: format!("{} steps left; {}", left, why.join("; ")),
            });
        }
        Ok(losses.into_inner())
    }

    /// End the job because of `lost`: every task still reachable returns it from `run_role`.
    fn abort(&self, lost: &Error) {
        let reason = encode_lost(lost);
        for (i, w) in self.workers.iter().enumerate() {
            if let Some(c) = w.lock().as_mut() {
                let _ = exchange(c, OP_ABORT, &reason, &format!("worker {i}"));
            }
        }
        for (i, p) in self.ps.iter().enumerate() {
            let _ = exchange(&mut p.lock(), OP_ABORT, &reason, &format!("ps task {i}"));
        }
    }

    /// Tell every task the job is over.
    pub fn shutdown(self) -> Result<()> {
        for w in self.workers.iter() {
            if let Some(c) = w.lock().as_mut() {
                let _ = call(c, OP_SHUTDOWN, &[], "worker");
            }
        }
        for p in &self.ps {
            call(&mut p.lock(), OP_SHUTDOWN, &[], "ps task")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitioner() {
        assert_eq!(Partitioner::MaxShards(2).shards(100, 3), 2);
        assert_eq!(Partitioner::MaxShards(8).shards(100, 3), 3);
        assert_eq!(Partitioner::MaxShards(8).shards(2, 3), 2);
        assert_eq!(Partitioner::MinShardBytes(100).shards(100, 8), 4);
        assert_eq!(Partitioner::MinShardBytes(1 << 20).shards(100, 8), 1);
        let layout = vec![vec![
            Shard {
                ps: 1,
                var: 0,
                index: 0,
                len: 5,
            },
            Shard {
                ps: 0,
                var: 0,
                index: 1,
                len: 4,
            },
        ]];
        let d = decode_layout(&encode_layout(&layout));
        assert_eq!(d[0][1].len, 4);
        assert_eq!(d[0][0].ps, 1);
    }
}
