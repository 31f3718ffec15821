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
//! Variables are floats ([`Values`]: f32, f64, f16, bf16). The ps task holding a shard applies
//! each gradient pushed to it with an update [`Rule`] (SGD, with or without momentum, or Adam),
//! keeping the rule's slots (momentum, moments) beside the shard, as TensorFlow keeps slot
//! variables on the ps tasks: by default the rule the variable was created with, or the one a
//! step pushes with ([`StepContext::push`]). Adam's step count is the shard's: the pushes it
//! has taken with those slots.
//! Every connection proves the job token (the same handshake as the collectives).

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::cluster::auth::{handshake_client, Acceptor, Purpose, HANDSHAKE_LIMIT};
use crate::cluster::{split_addr, ClusterSpec};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::strategy::training::{steps_wide, AnySlots, Param, SlotState};
use crate::strategy::Rule;

/// How a variable is cut into shards across the ps tasks. Shards go to the ps tasks in turn,
/// so a task may hold several shards of one variable; no variable has more shards than
/// elements, nor fewer than one.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Partitioner {
    /// At most this many shards, and no more than there are ps tasks.
    MaxShards(usize),
    /// Exactly this many shards (TensorFlow's `FixedShardsPartitioner`); at least 1, no more
    /// than the variable's elements.
    FixedShards(usize),
    /// Shards of at least this many bytes, no more than there are ps tasks (TensorFlow's
    /// `MinSizePartitioner` with `max_shards` the ps tasks).
    MinShardBytes(usize),
    /// Shards of at most this many bytes (but one element at least), as few as that allows
    /// (TensorFlow's `MaxSizePartitioner`).
    MaxShardBytes(usize),
}

impl Partitioner {
    /// Shard count for a variable of `len` f32 elements over `ps` tasks.
    pub fn shards(self, len: usize, ps: usize) -> usize {
        self.shards_of(len, 4, ps)
    }

    /// Shard count for a variable of `len` elements of `size` bytes over `ps` tasks.
    pub fn shards_of(self, len: usize, size: usize, ps: usize) -> usize {
        let bytes = len.saturating_mul(size);
        let n = match self {
            Partitioner::MaxShards(k) => k.min(ps.max(1)),
            Partitioner::FixedShards(k) => k,
            Partitioner::MinShardBytes(b) => (bytes / b.max(1)).min(ps.max(1)),
            // Whole elements per shard: no shard past `b` bytes (but one element).
            Partitioner::MaxShardBytes(b) => len.div_ceil((b / size.max(1)).max(1)),
        };
        n.max(1).min(len.max(1))
    }
}

/// A variable's elements (or a gradient's), in its dtype: the ps tasks hold floats.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// IEEE 754 binary32.
    F32(Vec<f32>),
    /// IEEE 754 binary64.
    F64(Vec<f64>),
    /// IEEE 754 binary16 (updates computed in f32).
    F16(Vec<half::f16>),
    /// bfloat16 (updates computed in f32).
    BF16(Vec<half::bf16>),
}

/// The element types a parameter-server variable may hold (those of [`Values`]).
pub trait PsElement: Param {
    /// `v` as [`Values`].
    fn wrap(v: Vec<Self>) -> Values;
    /// The elements of `v`, if they are of this type.
    fn unwrap(v: &Values) -> Option<&[Self]>;
}

macro_rules! ps_element {
    ($t:ty, $variant:ident) => {
        impl PsElement for $t {
            fn wrap(v: Vec<$t>) -> Values {
                Values::$variant(v)
            }
            fn unwrap(v: &Values) -> Option<&[$t]> {
                match v {
                    Values::$variant(x) => Some(x),
                    _ => None,
                }
            }
        }
        impl From<Vec<$t>> for Values {
            fn from(v: Vec<$t>) -> Values {
                Values::$variant(v)
            }
        }
    };
}
ps_element!(f32, F32);
ps_element!(f64, F64);
ps_element!(half::f16, F16);
ps_element!(half::bf16, BF16);

/// Run `$body` with `$x` bound to the elements of `$v` (whichever type they are).
macro_rules! with_values {
    ($v:expr, $x:ident => $body:expr) => {
        match $v {
            Values::F32($x) => $body,
            Values::F64($x) => $body,
            Values::F16($x) => $body,
            Values::BF16($x) => $body,
        }
    };
}

impl Values {
    /// Its dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Values::F32(_) => DType::F32,
            Values::F64(_) => DType::F64,
            Values::F16(_) => DType::F16,
            Values::BF16(_) => DType::BF16,
        }
    }

    /// Its elements.
    pub fn len(&self) -> usize {
        with_values!(self, x => x.len())
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `at..at + n`.
    fn slice(&self, at: usize, n: usize) -> Values {
        with_values!(self, x => x[at..at + n].to_vec().into())
    }

    /// Append `other`'s elements (of the same type; another is left out).
    fn extend(&mut self, other: &Values) {
        fn go<T: PsElement>(x: &mut Vec<T>, other: &Values) {
            if let Some(o) = other.get::<T>() {
                x.extend_from_slice(o);
            }
        }
        with_values!(self, x => go(x, other))
    }

    /// Its elements, if they are `T`s.
    pub fn get<T: PsElement>(&self) -> Option<&[T]> {
        T::unwrap(self)
    }

    /// Its elements, if they are f32s.
    pub fn as_f32(&self) -> Option<&[f32]> {
        self.get()
    }

    /// Its elements' bytes as they lie in memory: little-endian, as on the wire, on every
    /// machine tutti runs on (x86-64, AArch64).
    pub fn as_bytes(&self) -> &[u8] {
        with_values!(self, x => bytemuck::cast_slice(x))
    }

    /// `n` zeros of `dtype` (a dtype the ps tasks do not hold is an error).
    pub fn zeros(dtype: DType, n: usize) -> Result<Values> {
        Values::from_bytes(dtype, &[]).map_err(Error::config)?;
        let bytes = n
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::config(format!("{n} elements of {dtype}: too many")))?;
        Values::from_bytes(dtype, &vec![0; bytes]).map_err(Error::config)
    }

    /// Elements of `dtype` from their little-endian bytes; an error says why they are not.
    pub fn from_bytes(dtype: DType, b: &[u8]) -> std::result::Result<Values, String> {
        if b.len() % dtype.size() != 0 {
            return Err(format!("{} bytes are not whole {dtype} elements", b.len()));
        }
        Ok(match dtype {
            DType::F32 => Values::F32(collect(b)),
            DType::F64 => Values::F64(collect(b)),
            DType::F16 => Values::F16(collect(b)),
            DType::BF16 => Values::BF16(collect(b)),
            other => return Err(unheld(other)),
        })
    }
}

/// The elements whose little-endian bytes are `b` (whole elements: checked by the caller).
fn collect<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut(&mut v).copy_from_slice(b);
    v
}

/// Why a ps task cannot hold `dtype`.
fn unheld(dtype: DType) -> String {
    format!("parameter-server variables are floats (f32, f64, f16, bf16), not {dtype}")
}

/// A dtype as a layout or request carries it.
fn dtype_of(word: u32) -> std::result::Result<DType, String> {
    let d = DType::from_u32(word).ok_or_else(|| format!("unknown dtype {word}"))?;
    Values::from_bytes(d, &[]).map(|_| d)
}

/// Step `w` by `g` with `rule` (both of one dtype and length: checked by the caller).
fn apply(
    rule: &Rule,
    slots: &mut AnySlots,
    w: &mut Values,
    g: &Values,
) -> std::result::Result<(), String> {
    fn go<T: PsElement>(
        rule: &Rule,
        slots: &mut AnySlots,
        w: &mut [T],
        g: &Values,
    ) -> std::result::Result<(), String> {
        let g = g
            .get::<T>()
            .ok_or_else(|| format!("a {} gradient for a {} variable", g.dtype(), T::DTYPE))?;
        if g.len() != w.len() {
            return Err(format!(
                "gradient of {} elements for a shard of {}",
                g.len(),
                w.len()
            ));
        }
        rule.step(slots, w, g);
        Ok(())
    }
    with_values!(w, x => go(rule, slots, x, g))
}

/// The kind of a rule, as a request carries it (and as the slots are kept apart by).
fn rule_kind(rule: &Rule) -> u32 {
    match rule {
        Rule::Sgd { .. } => 0,
        Rule::Adam { .. } => 1,
    }
}

/// Plain SGD at rate `lr`.
pub(crate) fn sgd(lr: f32) -> Rule {
    Rule::Sgd {
        learning_rate: lr,
        momentum: 0.0,
        nesterov: false,
    }
}

/// What a push that names no rule carries in its place (the ps task ignores it).
const PLAIN: Rule = Rule::Sgd {
    learning_rate: 1.0,
    momentum: 0.0,
    nesterov: false,
};

/// A rule a push names and the key of its slots; `None`: the shard's own rule.
type KeyedRule = Option<(Rule, u64)>;

/// Bytes of an update rule as a request carries it: kind, learning rate, three
/// hyper-parameters, then the slots' key.
const RULE_BYTES: usize = 28;

fn encode_rule(rule: &Rule, slots: u64, b: &mut Vec<u8>) {
    let kind = rule_kind(rule);
    let p = match *rule {
        Rule::Sgd {
            learning_rate,
            momentum,
            nesterov,
        } => [learning_rate, momentum, nesterov as u32 as f32, 0.0],
        Rule::Adam {
            learning_rate,
            beta_1,
            beta_2,
            epsilon,
        } => [learning_rate, beta_1, beta_2, epsilon],
    };
    b.extend_from_slice(&kind.to_le_bytes());
    for x in p {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b.extend_from_slice(&slots.to_le_bytes());
}

/// An update rule and its slots' key from [`RULE_BYTES`] bytes; a rule that cannot step a
/// variable is an error saying why.
fn decode_rule(b: &[u8]) -> std::result::Result<(Rule, u64), String> {
    let f = |i: usize| f32::from_bits(u32_at(b, i));
    let rule = match u32_at(b, 0) {
        0 => Rule::Sgd {
            learning_rate: f(1),
            momentum: f(2),
            nesterov: f(3) != 0.0,
        },
        1 => Rule::Adam {
            learning_rate: f(1),
            beta_1: f(2),
            beta_2: f(3),
            epsilon: f(4),
        },
        k => return Err(format!("unknown update rule {k}")),
    };
    rule.check()?;
    let slots = u64::from_le_bytes(b[20..28].try_into().expect("8 bytes"));
    Ok((rule, slots))
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
/// Read a shard's slots of a rule (payload: variable, shard, whether the rule is a pushed one,
/// the rule; answer: [`encode_slots`]).
const OP_READ_SLOTS: u32 = 8;
/// Set a shard's slots of a rule (payload: as [`OP_READ_SLOTS`]'s, then [`encode_slots`]).
const OP_SET_SLOTS: u32 = 9;
/// A worker's answer to a step whose step function failed (payload: its message). The worker
/// stays in the job.
const OP_STEP_FAILED: u32 = 102;
/// A worker's answer to a step it could not run because a ps task is gone (payload:
/// [`encode_lost`]). The worker leaves the job with that error.
const OP_TASK_LOST: u32 = 103;

/// The most bytes of an error message a task takes from a peer.
const MAX_ERROR: u64 = 64 << 10;
/// The most bytes of a layout (SETUP): some 800,000 shards (20 bytes each).
const MAX_LAYOUT: u64 = 16 << 20;
/// The most elements of one shard: a layout carries its length as a `u32`.
const MAX_SHARD: u64 = u32::MAX as u64;
/// The most shards of one variable (a layout holds some 800,000 in all).
const MAX_VARIABLE_SHARDS: usize = 1 << 16;
/// The most bytes of what a scheduled step carries to its worker ([`Coordinator::schedule`]),
/// and of what it sends back ([`StepContext::set_output`]).
pub const MAX_STEP_BYTES: usize = 256 << 20;
/// Bytes of a message's header: its op and its payload's length.
const HEADER: usize = 12;

fn send(s: &mut TcpStream, op: u32, payload: &[u8]) -> std::io::Result<()> {
    let mut m = Vec::with_capacity(HEADER + payload.len());
    m.extend_from_slice(&op.to_le_bytes());
    m.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    m.extend_from_slice(payload);
    s.write_all(&m)
}

/// A message header's op and payload length.
fn parse_header(h: &[u8; HEADER]) -> (u32, u64) {
    (
        u32::from_le_bytes(h[..4].try_into().expect("4 bytes")),
        u64::from_le_bytes(h[4..].try_into().expect("8 bytes")),
    )
}

fn invalid(why: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, why)
}

/// Read one message: its header, then its payload, which `bound` (given the op) limits before
/// anything is allocated (an `InvalidData` error saying why otherwise); what is allocated grows
/// with the bytes that arrive.
fn recv(
    s: &mut TcpStream,
    bound: impl FnOnce(u32) -> std::result::Result<u64, String>,
) -> std::io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h)?;
    let (op, len) = parse_header(&h);
    let most = bound(op).map_err(invalid)?;
    if len > most {
        return Err(invalid(format!(
            "a message (op {op}) of {len} bytes, more than the {most} it may hold"
        )));
    }
    let mut p = Vec::new();
    if ((&mut *s).take(len).read_to_end(&mut p)? as u64) < len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok((op, p))
}

/// Request and answer. A broken connection (or no answer within the timeout) is
/// [`Error::TaskLost`] naming `who`; an answer this request cannot have (of an unknown kind,
/// or an `OP_OK` whose length is outside `want`) is an error naming `who` too.
fn exchange(
    s: &mut TcpStream,
    op: u32,
    payload: &[u8],
    who: &str,
    want: std::ops::RangeInclusive<usize>,
) -> Result<(u32, Vec<u8>)> {
    let failed = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::InvalidData => Error::System {
            what: format!("parameter-server call to {who}"),
            message: e.to_string(),
        },
        _ => Error::TaskLost {
            task: who.to_string(),
            detail: e.to_string(),
        },
    };
    send(s, op, payload).map_err(failed)?;
    let (r, p) = recv(s, |r| match r {
        OP_OK => Ok(*want.end() as u64),
        OP_ERR | OP_STEP_FAILED | OP_TASK_LOST => Ok(MAX_ERROR),
        r => Err(format!("an answer of unknown kind {r}")),
    })
    .map_err(failed)?;
    if r == OP_OK && !want.contains(&p.len()) {
        let due = if want.start() == want.end() {
            want.start().to_string()
        } else {
            format!("{} to {}", want.start(), want.end())
        };
        return Err(failed(invalid(format!(
            "an answer of {} bytes where {due} were due",
            p.len()
        ))));
    }
    Ok((r, p))
}

/// Request and answer; an `OP_ERR` answer becomes an error carrying the peer's message. An
/// `OP_OK` answer has the length the request's op calls for (a step: the loss, then what the
/// step sent back; nothing else), or the error says what came.
fn call(s: &mut TcpStream, op: u32, payload: &[u8], who: &str) -> Result<Vec<u8>> {
    match op {
        OP_STEP => call_within(s, op, payload, who, STEP_ANSWER),
        _ => call_sized(s, op, payload, who, 0),
    }
}

/// What a step's `OP_OK` answer may hold: its loss, then at most [`MAX_STEP_BYTES`].
const STEP_ANSWER: std::ops::RangeInclusive<usize> = 4..=4 + MAX_STEP_BYTES;

/// [`call`], whose `OP_OK` answer has `want` bytes.
fn call_sized(
    s: &mut TcpStream,
    op: u32,
    payload: &[u8],
    who: &str,
    want: usize,
) -> Result<Vec<u8>> {
    call_within(s, op, payload, who, want..=want)
}

/// [`call`], whose `OP_OK` answer's length is within `want`.
fn call_within(
    s: &mut TcpStream,
    op: u32,
    payload: &[u8],
    who: &str,
    want: std::ops::RangeInclusive<usize>,
) -> Result<Vec<u8>> {
    match exchange(s, op, payload, who, want)? {
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
    let text = match e {
        Error::TaskLost { task, detail } => format!("{task}\n{detail}"),
        other => format!("a task\n{other}"),
    };
    let mut b = text.into_bytes();
    b.truncate(MAX_ERROR as usize);
    b
}

fn decode_lost(p: &[u8]) -> Error {
    let text = String::from_utf8_lossy(p);
    let (task, detail) = text.split_once('\n').unwrap_or(("a task", &text));
    Error::TaskLost {
        task: task.to_string(),
        detail: detail.to_string(),
    }
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    b.get(i * 4..i * 4 + 4)
        .map_or(0, |c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
}

/// A request to a ps or worker task, read.
#[derive(Clone, Debug, PartialEq)]
enum Request {
    /// Hold a shard (or set the values of one held, keeping its slots).
    Create {
        var: u32,
        shard: u32,
        rule: Rule,
        values: Values,
    },
    Pull {
        var: u32,
        shard: u32,
    },
    /// Step a shard by a gradient of its dtype, with a rule and its slots' key (`None`: the
    /// shard's own rule).
    Push {
        var: u32,
        shard: u32,
        dtype: DType,
        rule: KeyedRule,
        grad: Vec<u8>,
    },
    Setup(Vec<Vec<Shard>>),
    /// Run a step: its number, and what the coordinator scheduled it with.
    Step {
        step: u64,
        payload: Vec<u8>,
    },
    Shutdown,
    /// The job ends because this task was lost.
    Abort(Error),
    /// A shard's slots of a rule (`None`: the shard's own rule's).
    ReadSlots {
        var: u32,
        shard: u32,
        rule: KeyedRule,
    },
    /// Set a shard's slots of a rule to `state` ([`encode_slots`]'s bytes, checked against the
    /// shard when it is set).
    SetSlots {
        var: u32,
        shard: u32,
        rule: KeyedRule,
        state: Vec<u8>,
    },
}

/// Bytes before a SET_SLOTS's state: variable, shard, whether a rule follows, rule.
const SLOTS_FIXED: usize = 12 + RULE_BYTES;

/// A READ_SLOTS or SET_SLOTS request for shard `s` and `rule` (`None`: its own), with `state`
/// ([`encode_slots`]) for a SET_SLOTS.
fn slots_request(s: &Shard, rule: KeyedRule, state: &[u8]) -> Vec<u8> {
    let mut req = Vec::with_capacity(SLOTS_FIXED + state.len());
    for w in [s.var, s.index, rule.is_some() as u32] {
        req.extend_from_slice(&w.to_le_bytes());
    }
    let (r, key) = rule.unwrap_or((PLAIN, 0));
    encode_rule(&r, key, &mut req);
    req.extend_from_slice(state);
    req
}

/// A rule's state as it travels: the steps taken (u32), then the first slot's bytes and the
/// second's, those the rule keeps (each as long as the shard, in the rule's arithmetic).
fn encode_slots(state: &SlotState) -> Vec<u8> {
    let mut b = state.steps.to_le_bytes().to_vec();
    for v in [&state.first, &state.second].into_iter().flatten() {
        b.extend_from_slice(v.as_bytes());
    }
    b
}

/// The bytes [`encode_slots`] gives for `rule`'s state of a shard of `len` elements of
/// `dtype`.
fn slots_bytes(rule: &Rule, len: usize, dtype: DType) -> usize {
    let (a, b) = rule.slots_used();
    let arith = if steps_wide(dtype) { 8 } else { 4 };
    4 + (a as usize + b as usize) * len * arith
}

/// `rule`'s state of a shard of `len` elements of `dtype` from [`encode_slots`]'s bytes; bytes
/// of another length are an error.
fn decode_slots(
    rule: &Rule,
    len: usize,
    dtype: DType,
    b: &[u8],
) -> std::result::Result<SlotState, String> {
    let due = slots_bytes(rule, len, dtype);
    if b.len() != due {
        return Err(format!(
            "slots of {} bytes for a shard whose rule keeps {due}",
            b.len()
        ));
    }
    let arith = if steps_wide(dtype) {
        DType::F64
    } else {
        DType::F32
    };
    let (a, second) = rule.slots_used();
    let each = len * arith.size();
    let part = |used: bool, at: usize| -> std::result::Result<Option<Values>, String> {
        used.then(|| Values::from_bytes(arith, &b[at..at + each]))
            .transpose()
    };
    Ok(SlotState {
        steps: u32_at(b, 0),
        first: part(a, 4)?,
        second: part(second, 4 + if a { each } else { 0 })?,
    })
}

/// Bytes before a CREATE's values: variable, shard, dtype, rule.
const CREATE_FIXED: usize = 12 + RULE_BYTES;
/// Bytes before a PUSH's gradient: variable, shard, dtype, whether a rule follows, rule.
const PUSH_FIXED: usize = 16 + RULE_BYTES;

/// The most payload bytes a request of `op` may have, on a task whose largest shard has
/// `largest` bytes.
fn request_bound(op: u32, largest: usize) -> std::result::Result<u64, String> {
    Ok(match op {
        OP_SHUTDOWN => 0,
        OP_ABORT => MAX_ERROR,
        OP_PULL => 8,
        OP_STEP => 8 + MAX_STEP_BYTES as u64,
        OP_PUSH => (PUSH_FIXED + largest) as u64,
        OP_CREATE => CREATE_FIXED as u64 + 8 * MAX_SHARD,
        OP_SETUP => MAX_LAYOUT,
        OP_READ_SLOTS => SLOTS_FIXED as u64,
        // Two f32 slots for each element of an f16 or bf16 shard at most: four times its bytes.
        OP_SET_SLOTS => (SLOTS_FIXED + 4 + 4 * largest) as u64,
        other => return Err(format!("unknown request {other}")),
    })
}

impl Request {
    /// Read the payload `p` of a request of `op`.
    fn decode(op: u32, p: &[u8]) -> std::result::Result<Request, String> {
        let fixed = |what: &str, n: usize| {
            if p.len() < n {
                return Err(format!("a {what} request of {} bytes, under {n}", p.len()));
            }
            Ok(())
        };
        let exact = |what: &str, n: usize| {
            if p.len() != n {
                return Err(format!("a {what} request of {} bytes, not {n}", p.len()));
            }
            Ok(())
        };
        Ok(match op {
            OP_CREATE => {
                fixed("CREATE", CREATE_FIXED)?;
                let (rule, _) = decode_rule(&p[12..CREATE_FIXED])?;
                let values = Values::from_bytes(dtype_of(u32_at(p, 2))?, &p[CREATE_FIXED..])?;
                Request::Create {
                    var: u32_at(p, 0),
                    shard: u32_at(p, 1),
                    rule,
                    values,
                }
            }
            OP_PULL => {
                exact("PULL", 8)?;
                Request::Pull {
                    var: u32_at(p, 0),
                    shard: u32_at(p, 1),
                }
            }
            OP_PUSH => {
                fixed("PUSH", PUSH_FIXED)?;
                let rule = match u32_at(p, 3) {
                    0 => None,
                    _ => Some(decode_rule(&p[16..PUSH_FIXED])?),
                };
                Request::Push {
                    var: u32_at(p, 0),
                    shard: u32_at(p, 1),
                    dtype: dtype_of(u32_at(p, 2))?,
                    rule,
                    grad: p[PUSH_FIXED..].to_vec(),
                }
            }
            OP_SETUP => Request::Setup(decode_layout(p)?),
            OP_STEP => {
                if p.len() < 8 {
                    return Err(format!("a STEP request of {} bytes, under 8", p.len()));
                }
                Request::Step {
                    step: u64::from_le_bytes(p[..8].try_into().expect("8 bytes")),
                    payload: p[8..].to_vec(),
                }
            }
            OP_SHUTDOWN => {
                exact("SHUTDOWN", 0)?;
                Request::Shutdown
            }
            OP_ABORT => Request::Abort(decode_lost(p)),
            OP_READ_SLOTS | OP_SET_SLOTS => {
                let what = if op == OP_READ_SLOTS {
                    "READ_SLOTS"
                } else {
                    "SET_SLOTS"
                };
                fixed(what, SLOTS_FIXED)?;
                if op == OP_READ_SLOTS {
                    exact(what, SLOTS_FIXED)?;
                }
                let rule = match u32_at(p, 2) {
                    0 => None,
                    _ => Some(decode_rule(&p[12..SLOTS_FIXED])?),
                };
                let (var, shard) = (u32_at(p, 0), u32_at(p, 1));
                match op {
                    OP_READ_SLOTS => Request::ReadSlots { var, shard, rule },
                    _ => Request::SetSlots {
                        var,
                        shard,
                        rule,
                        state: p[SLOTS_FIXED..].to_vec(),
                    },
                }
            }
            other => return Err(format!("unknown request {other}")),
        })
    }
}

/// Where one shard lives.
#[derive(Clone, Debug, PartialEq)]
struct Shard {
    ps: usize,
    var: u32,
    index: u32,
    len: usize,
    dtype: DType,
}

/// What a worker's step function sees.
pub struct StepContext {
    step: u64,
    worker: usize,
    num_workers: usize,
    variables: Vec<Values>,
    payload: Vec<u8>,
    output: Mutex<Vec<u8>>,
    pushes: Mutex<Vec<Push>>,
}

/// A gradient a step pushes with a rule of its own ([`StepContext::push`]).
struct Push {
    variable: usize,
    grad: Values,
    rule: Rule,
    slots: u64,
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
    /// Every variable's value as pulled for this step, in creation order.
    pub fn variables(&self) -> &[Values] {
        &self.variables
    }
    /// What the coordinator scheduled this step with ([`Coordinator::schedule`]); empty for
    /// the steps of [`Coordinator::run_steps`].
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
    /// Send `bytes` back with the step's loss: the coordinator's [`RemoteValue`] holds them.
    /// At most [`MAX_STEP_BYTES`]; more fails the step.
    pub fn set_output(&self, bytes: Vec<u8>) {
        *self.output.lock() = bytes;
    }

    /// Push `grad` to variable `variable` with `rule` (not the variable's own), once the step
    /// function has returned: the ps tasks step each shard by it with the slots `slots` keys
    /// (one key per optimizer: two optimizers stepping one variable keep apart). What the
    /// step function returns is pushed too. A gradient of another dtype or length than its
    /// variable's, or a rule that cannot step (a learning rate that is negative), fails
    /// the step before anything is pushed.
    pub fn push(&self, variable: usize, grad: Values, rule: Rule, slots: u64) {
        self.pushes.lock().push(Push {
            variable,
            grad,
            rule,
            slots,
        });
    }
}

/// A worker's step: a gradient per variable (in its dtype, stepped by its rule), and the loss.
/// An empty gradient leaves its variable alone, and so does an empty list (a step that only
/// reads, such as an evaluation).
pub type StepResult = Result<(Vec<Values>, f32)>;

/// What [`ParameterServerStrategy::run_role`] leaves this process to do.
// One per task, made once: its size does not matter.
#[allow(clippy::large_enum_variant)]
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
                    running: Mutex::new((false, 0)),
                    idle: parking_lot::Condvar::new(),
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

/// A shard held by a ps task: its values, its own update rule and that rule's slots, and the
/// slots of each rule a push named, by the rule's kind and the push's key.
struct HeldShard {
    values: Values,
    rule: Rule,
    own: AnySlots,
    slots: HashMap<(u32, u64), AnySlots>,
}

/// The most optimizers' slots one shard keeps (beside its own rule's): more is a caller's
/// mistake (an optimizer made anew in every step, whose state would never carry over).
const MAX_SLOT_KEYS: usize = 64;

impl HeldShard {
    /// Step the shard by the gradient `g` (bytes of `dtype`) with `rule` (`None`: its own).
    fn step(&mut self, dtype: DType, g: &[u8], rule: KeyedRule) -> std::result::Result<(), String> {
        if dtype != self.values.dtype() {
            return Err(format!(
                "a {dtype} gradient for a shard of {}",
                self.values.dtype()
            ));
        }
        let g = Values::from_bytes(dtype, g)?;
        let (rule, slots) = match rule {
            None => (self.rule, &mut self.own),
            Some((rule, key)) => {
                let k = (rule_kind(&rule), key);
                if !self.slots.contains_key(&k) && self.slots.len() >= MAX_SLOT_KEYS {
                    return Err(format!(
                        "more than {MAX_SLOT_KEYS} optimizers' slots on one shard (an optimizer \
                         made anew in each step? make it once, outside the step)"
                    ));
                }
                (rule, self.slots.entry(k).or_default())
            }
        };
        apply(&rule, slots, &mut self.values, &g)
    }

    /// The rule and slots a READ_SLOTS or SET_SLOTS names: the shard's own (`None`), or a
    /// pushed rule's (made where `make`, within [`MAX_SLOT_KEYS`]; else `None` where none is
    /// kept yet).
    fn slots_of(
        &mut self,
        rule: KeyedRule,
        make: bool,
    ) -> std::result::Result<(Rule, Option<&mut AnySlots>), String> {
        match rule {
            None => Ok((self.rule, Some(&mut self.own))),
            Some((rule, key)) => {
                let k = (rule_kind(&rule), key);
                if make && !self.slots.contains_key(&k) && self.slots.len() >= MAX_SLOT_KEYS {
                    return Err(format!(
                        "more than {MAX_SLOT_KEYS} optimizers' slots on one shard"
                    ));
                }
                Ok(match make {
                    true => (rule, Some(self.slots.entry(k).or_default())),
                    false => (rule, self.slots.get_mut(&k)),
                })
            }
        }
    }

    /// The slots of `rule` ([`encode_slots`]; zeros where it has not stepped this shard).
    fn read_slots(&mut self, rule: KeyedRule) -> std::result::Result<Vec<u8>, String> {
        let (len, wide) = (self.values.len(), steps_wide(self.values.dtype()));
        let (rule, slots) = self.slots_of(rule, false)?;
        let state = match slots {
            Some(s) => s.export(&rule, len, wide),
            None => AnySlots::default().export(&rule, len, wide),
        };
        Ok(encode_slots(&state))
    }

    /// Set the slots of `rule` from [`encode_slots`]'s bytes (checked against this shard).
    fn set_slots(&mut self, rule: KeyedRule, b: &[u8]) -> std::result::Result<(), String> {
        let (len, dtype) = (self.values.len(), self.values.dtype());
        let (r, _) = self.slots_of(rule, false)?;
        let state = decode_slots(&r, len, dtype, b)?;
        if r.slots_used() == (false, false) {
            // Plain SGD keeps nothing: no entry is made for it.
            return Ok(());
        }
        let (r, slots) = self.slots_of(rule, true)?;
        let slots = slots.expect("made");
        let mut set = slots.clone();
        set.import(&r, len, steps_wide(dtype), &state)?;
        *slots = set;
        Ok(())
    }
}

/// A ps task's shards by (variable, shard), and why the task's job ended early, if it did.
#[derive(Default)]
struct PsState {
    shards: Mutex<HashMap<(u32, u32), HeldShard>>,
    /// The bytes of the largest shard held: what a PUSH may carry.
    largest: std::sync::atomic::AtomicUsize,
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
    /// Whether the role has ended, and the step functions running: `run_role` returns only
    /// once none runs (a C or Python step function must not be called after it returns).
    running: Mutex<(bool, usize)>,
    idle: parking_lot::Condvar,
}

fn connect(addr: &str, token: &str, timeout: Duration) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left.clamp(Duration::from_millis(1), Duration::from_secs(5));
        match connect_once(addr, token, wait, timeout) {
            Ok(s) => return Ok(s),
            Err(e @ Error::InvalidArgument { .. }) => return Err(e),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// One attempt to connect to `addr` and prove the token within `wait`; the connection's reads
/// and writes then wait up to `timeout`.
fn connect_once(addr: &str, token: &str, wait: Duration, timeout: Duration) -> Result<TcpStream> {
    let sa = addr
        .to_socket_addrs()
        .map_err(|e| Error::io(format!("resolving {addr}"), e))?
        .next()
        .ok_or_else(|| Error::config(format!("{addr} resolves to nothing")))?;
    let mut s = crate::cluster::auth::connect(&sa, wait)
        .map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
    handshake_client(
        &mut s,
        token,
        Purpose::Data,
        u32::MAX,
        wait.min(HANDSHAKE_LIMIT),
    )?;
    s.set_read_timeout(Some(timeout))
        .and_then(|_| s.set_write_timeout(Some(timeout)))
        .map_err(|e| Error::io("configuring a connection", e))?;
    let _ = s.set_nodelay(true);
    Ok(s)
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
    serve_on(listener, addr, token, timeout, ps, worker)
}

/// [`serve`] on a bound listener. The handshakes run on this thread, without blocking (see
/// `Acceptor`); a connection that proved the token gets a thread of its own.
fn serve_on(
    listener: TcpListener,
    addr: &str,
    token: &str,
    timeout: Duration,
    ps: Arc<PsState>,
    worker: Option<Arc<WorkerState>>,
) -> Result<()> {
    let served = serve_until_done(listener, addr, token, timeout, &ps, &worker);
    // However serving ended, no step function runs once this returns.
    if let Some(w) = &worker {
        w.close();
    }
    served?;
    match ps.failure.lock().take() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn serve_until_done(
    listener: TcpListener,
    addr: &str,
    token: &str,
    timeout: Duration,
    ps: &Arc<PsState>,
    worker: &Option<Arc<WorkerState>>,
) -> Result<()> {
    let mut acceptor = Acceptor::new(listener, token, Purpose::Data, "parameter-server")?;
    let done = Arc::new(AtomicBool::new(false));
    let mut last = Instant::now();
    let mut handlers: Vec<std::thread::JoinHandle<()>> = Vec::new();
    while !done.load(Ordering::Acquire) {
        match acceptor.next(Instant::now() + Duration::from_millis(5))? {
            Some((mut s, _)) => {
                last = Instant::now();
                let Ok(peer) = s.peer_addr() else { continue };
                let _ = s.set_nodelay(true);
                let (ps, worker, done) = (ps.clone(), worker.clone(), done.clone());
                let spawned = std::thread::Builder::new()
                    .name("tutti-ps-conn".into())
                    .spawn(move || handle(&mut s, peer, &ps, worker.as_deref(), &done));
                match spawned {
                    Ok(h) => handlers.push(h),
                    Err(e) => log::warn!(
                        "parameter server {addr}: no thread to serve {peer} ({e}); closing its \
                         connection"
                    ),
                }
            }
            None => {
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
            }
        }
    }
    Ok(())
}

fn handle(
    s: &mut TcpStream,
    peer: SocketAddr,
    ps: &PsState,
    worker: Option<&WorkerState>,
    done: &AtomicBool,
) {
    loop {
        let largest = ps.largest.load(Ordering::Acquire);
        let request = recv(s, |op| request_bound(op, largest))
            .and_then(|(op, p)| Request::decode(op, &p).map_err(invalid));
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    // A peer that proved the token but sent what no task sends: say why, and
                    // close (what follows cannot be trusted to start a message).
                    log::warn!("parameter server: a malformed request from {peer}: {e}");
                    let _ = send(s, OP_ERR, format!("malformed request: {e}").as_bytes());
                }
                return;
            }
        };
        let no_shard = |var: u32, shard: u32| format!("no shard {shard} of variable {var} here");
        let answer = match request {
            Request::Shutdown => {
                done.store(true, Ordering::Release);
                let _ = send(s, OP_OK, &[]);
                return;
            }
            Request::Abort(lost) => {
                *ps.failure.lock() = Some(lost);
                done.store(true, Ordering::Release);
                let _ = send(s, OP_OK, &[]);
                return;
            }
            Request::Create {
                var,
                shard,
                rule,
                values,
            } => {
                ps.largest
                    .fetch_max(values.as_bytes().len(), Ordering::AcqRel);
                let mut shards = ps.shards.lock();
                match shards.get_mut(&(var, shard)) {
                    // Set (a restored checkpoint): the slots stay.
                    Some(h)
                        if h.values.dtype() == values.dtype() && h.values.len() == values.len() =>
                    {
                        (h.values, h.rule) = (values, rule);
                    }
                    _ => {
                        shards.insert(
                            (var, shard),
                            HeldShard {
                                values,
                                rule,
                                own: AnySlots::default(),
                                slots: HashMap::new(),
                            },
                        );
                    }
                }
                Ok(Vec::new())
            }
            Request::Pull { var, shard } => match ps.shards.lock().get(&(var, shard)) {
                Some(h) => Ok(h.values.as_bytes().to_vec()),
                None => Err(no_shard(var, shard)),
            },
            Request::Push {
                var,
                shard,
                dtype,
                rule,
                grad,
            } => match ps.shards.lock().get_mut(&(var, shard)) {
                Some(h) => h.step(dtype, &grad, rule).map(|_| Vec::new()),
                None => Err(no_shard(var, shard)),
            },
            Request::ReadSlots { var, shard, rule } => {
                match ps.shards.lock().get_mut(&(var, shard)) {
                    Some(h) => h.read_slots(rule),
                    None => Err(no_shard(var, shard)),
                }
            }
            Request::SetSlots {
                var,
                shard,
                rule,
                state,
            } => match ps.shards.lock().get_mut(&(var, shard)) {
                Some(h) => h.set_slots(rule, &state).map(|_| Vec::new()),
                None => Err(no_shard(var, shard)),
            },
            Request::Setup(layout) => match worker {
                Some(w) => {
                    *w.layout.lock() = layout;
                    Ok(Vec::new())
                }
                None => Err("SETUP sent to a ps task".into()),
            },
            Request::Step { step, payload } => match worker {
                Some(w) => match w.step(step, payload) {
                    Ok(b) => Ok(b),
                    Err(e @ Error::TaskLost { .. }) => {
                        // Without that ps task this worker cannot run any step: it leaves the
                        // job with the error, once the coordinator has heard it.
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
                        let message = &message.as_bytes()[..message.len().min(MAX_ERROR as usize)];
                        if send(s, OP_STEP_FAILED, message).is_err() {
                            return;
                        }
                        continue;
                    }
                },
                None => Err("STEP sent to a ps task".into()),
            },
        };
        let sent = match answer {
            Ok(b) => send(s, OP_OK, &b),
            Err(m) => send(s, OP_ERR, &m.as_bytes()[..m.len().min(MAX_ERROR as usize)]),
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
            for v in [s.ps as u32, s.var, s.index, s.len as u32, s.dtype as u32] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    b
}

/// Read a layout: every count is checked against the bytes that hold it before anything is
/// allocated.
fn decode_layout(b: &[u8]) -> std::result::Result<Vec<Vec<Shard>>, String> {
    let short = || format!("a layout cut short ({} bytes)", b.len());
    if b.len() < 4 || b.len() % 4 != 0 {
        return Err(short());
    }
    let words = b.len() / 4;
    let mut i = 0;
    let mut next = || {
        i += 1;
        u32_at(b, i - 1)
    };
    let vars = next() as usize;
    // Every variable takes a word at least.
    if vars > words - 1 {
        return Err(short());
    }
    let mut layout = Vec::with_capacity(vars);
    let mut left = words - 1;
    for _ in 0..vars {
        if left == 0 {
            return Err(short());
        }
        let n = next() as usize;
        left -= 1;
        if n > left / 5 {
            return Err(short());
        }
        left -= 5 * n;
        let mut shards = Vec::with_capacity(n);
        for _ in 0..n {
            shards.push(Shard {
                ps: next() as usize,
                var: next(),
                index: next(),
                len: next() as usize,
                dtype: dtype_of(next())?,
            });
        }
        layout.push(shards);
    }
    if left != 0 {
        return Err(format!("a layout with {} bytes after its end", 4 * left));
    }
    Ok(layout)
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

    /// Refuse steps from now on, and wait for the running step functions to return (they are
    /// the trainer's code: waited for without a bound, with a warning each timeout).
    fn close(&self) {
        let mut running = self.running.lock();
        running.0 = true;
        while running.1 > 0 {
            if self.idle.wait_for(&mut running, self.timeout).timed_out() && running.1 > 0 {
                log::warn!(
                    "parameter-server worker {}: the job is over, waiting for {} step \
                     function(s) still running",
                    self.index,
                    running.1
                );
            }
        }
    }

    /// Pull every variable, run the step function, push the gradients; the loss and what the
    /// step sent back. Refused once the role has ended.
    fn step(&self, step: u64, payload: Vec<u8>) -> Result<Vec<u8>> {
        {
            let mut running = self.running.lock();
            if running.0 {
                return Err(Error::StepFailed {
                    worker: self.index,
                    step,
                    message: "this worker's part of the job has ended".into(),
                });
            }
            running.1 += 1;
        }
        /// Counts the step out however it ends (a panicking step function too).
        struct Out<'a>(&'a WorkerState);
        impl Drop for Out<'_> {
            fn drop(&mut self) {
                let mut running = self.0.running.lock();
                running.1 -= 1;
                if running.1 == 0 {
                    self.0.idle.notify_all();
                }
            }
        }
        let _out = Out(self);
        self.step_inner(step, payload)
    }

    fn step_inner(&self, step: u64, payload: Vec<u8>) -> Result<Vec<u8>> {
        let layout = self.layout.lock().clone();
        let mut variables = Vec::with_capacity(layout.len());
        for shards in &layout {
            variables.push(pull(shards, |ps, req, want| {
                self.with_ps(ps, |c| {
                    call_sized(c, OP_PULL, req, &format!("ps task {ps}"), want)
                })
            })?);
        }
        let ctx = StepContext {
            step,
            worker: self.index,
            num_workers: self.num_workers,
            variables,
            payload,
            output: Mutex::new(Vec::new()),
            pushes: Mutex::new(Vec::new()),
        };
        let failed = |message: String| Error::StepFailed {
            worker: self.index,
            step,
            message,
        };
        let (grads, loss) = (self.step_fn)(&ctx).map_err(|e| failed(e.to_string()))?;
        let output = ctx.output.into_inner();
        let pushes = ctx.pushes.into_inner();
        if output.len() > MAX_STEP_BYTES {
            return Err(failed(format!(
                "the step sent back {} bytes, more than the {MAX_STEP_BYTES} a step may",
                output.len()
            )));
        }
        if !grads.is_empty() && grads.len() != layout.len() {
            return Err(failed(format!(
                "the step returned {} gradients for {} variables",
                grads.len(),
                layout.len()
            )));
        }
        // Every gradient is checked before any is pushed.
        let all: Vec<(usize, &Values, KeyedRule)> = grads
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
            .map(|(i, g)| (i, g, None))
            .chain(
                pushes
                    .iter()
                    .map(|p| (p.variable, &p.grad, Some((p.rule, p.slots)))),
            )
            .collect();
        for &(i, g, rule) in &all {
            let Some(shards) = layout.get(i) else {
                return Err(failed(format!(
                    "a gradient for variable {i}; the job has {}",
                    layout.len()
                )));
            };
            let total: usize = shards.iter().map(|s| s.len).sum();
            let dtype = shards.first().map_or(DType::F32, |s| s.dtype);
            if g.len() != total || g.dtype() != dtype {
                return Err(failed(format!(
                    "a gradient of {} {} elements for variable {i} of {total} {dtype}",
                    g.len(),
                    g.dtype()
                )));
            }
            if let Some((r, _)) = rule {
                r.check()
                    .map_err(|why| failed(format!("a push to variable {i}: {why}")))?;
            }
        }
        for (i, g, rule) in all {
            let size = g.dtype().size();
            let mut at = 0;
            for s in &layout[i] {
                let req = push_request(s, rule, &g.as_bytes()[at * size..(at + s.len) * size]);
                at += s.len;
                self.with_ps(s.ps, |c| {
                    call(c, OP_PUSH, &req, &format!("ps task {}", s.ps))
                })?;
            }
        }
        let mut answer = loss.to_le_bytes().to_vec();
        answer.extend(output);
        Ok(answer)
    }
}

/// The shards of variable `id`, for `values` of its dtype and length (an error naming `what`
/// and both otherwise).
fn shards_of<'a>(
    layout: &'a [Vec<Shard>],
    id: VariableId,
    values: &Values,
    what: &str,
) -> Result<&'a [Shard]> {
    let shards = layout
        .get(id.0)
        .ok_or_else(|| Error::config(format!("no variable {}", id.0)))?;
    let total: usize = shards.iter().map(|s| s.len).sum();
    let dtype = shards.first().map_or(DType::F32, |s| s.dtype);
    if values.len() != total || values.dtype() != dtype {
        return Err(Error::config(format!(
            "{what}: {} {} values for variable {} of {total} {dtype} elements",
            values.len(),
            values.dtype(),
            id.0
        )));
    }
    Ok(shards)
}

/// A PUSH of `grad` (the shard's part, bytes of its dtype) to shard `s` with `rule`.
fn push_request(s: &Shard, rule: KeyedRule, grad: &[u8]) -> Vec<u8> {
    let mut req = Vec::with_capacity(PUSH_FIXED + grad.len());
    for w in [s.var, s.index, s.dtype as u32, rule.is_some() as u32] {
        req.extend_from_slice(&w.to_le_bytes());
    }
    let (r, key) = rule.unwrap_or((PLAIN, 0));
    encode_rule(&r, key, &mut req);
    req.extend_from_slice(grad);
    req
}

/// A variable's value from its shards, each pulled by `pull_one(ps task, request, bytes due)`.
fn pull(
    shards: &[Shard],
    mut pull_one: impl FnMut(usize, &[u8], usize) -> Result<Vec<u8>>,
) -> Result<Values> {
    let dtype = shards.first().map_or(DType::F32, |s| s.dtype);
    // Grown as the shards arrive (each checked against its length): not sized by the layout.
    let mut b = Vec::new();
    for s in shards {
        let mut req = s.var.to_le_bytes().to_vec();
        req.extend_from_slice(&s.index.to_le_bytes());
        b.extend(pull_one(s.ps, &req, s.len * dtype.size())?);
    }
    Values::from_bytes(dtype, &b).map_err(Error::config)
}

/// A handle on a variable created by the coordinator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct VariableId(usize);

impl VariableId {
    /// Its place in creation order (the index of its value in [`StepContext::variables`]).
    pub fn index(self) -> usize {
        self.0
    }

    /// The variable at `index` in creation order (a variable the coordinator has not made is
    /// an error where it is used).
    pub fn from_index(index: usize) -> VariableId {
        VariableId(index)
    }
}

/// What a step sent back: its loss, and the bytes it set ([`StepContext::set_output`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// The loss the step function returned.
    pub loss: f32,
    /// What the step function set with [`StepContext::set_output`] (empty if nothing).
    pub output: Vec<u8>,
}

type Slot = Arc<Mutex<Option<Result<StepOutput>>>>;

/// The result of a scheduled step ([`Coordinator::schedule`]), TensorFlow's `RemoteValue`:
/// read it with [`Coordinator::fetch`]. Clones share the result; it is freed with the last.
#[derive(Clone)]
pub struct RemoteValue {
    step: u64,
    slot: Slot,
}

impl RemoteValue {
    /// The step number the step function sees ([`StepContext::step`]).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Whether the step has run (or will not: an earlier failure cancelled it).
    pub fn is_ready(&self) -> bool {
        self.slot.lock().is_some()
    }
}

/// Steps scheduled and not yet run.
#[derive(Default)]
struct Schedule {
    next: u64,
    pending: Vec<(u64, Vec<u8>, Slot)>,
}

/// The longest the coordinator waits, before a run, for a lost worker's address to answer (one
/// attempt, every lost worker at once), and the least time between two tries of one worker.
const REJOIN_WAIT: Duration = Duration::from_secs(1);
/// The most steps one `run_steps` call may run.
const MAX_RUN_STEPS: usize = 1 << 24;

/// The chief's side: creates variables, schedules steps, reads results, shuts the job down.
pub struct Coordinator {
    workers: Vec<Mutex<Option<TcpStream>>>,
    worker_addrs: Vec<String>,
    ps: Vec<Mutex<TcpStream>>,
    layout: Mutex<Vec<Vec<Shard>>>,
    /// Each variable's update rule, in creation order (what `assign_variable` sets its
    /// shards with).
    rules: Mutex<Vec<Rule>>,
    partitioner: Partitioner,
    token: String,
    timeout: Duration,
    schedule: Mutex<Schedule>,
    /// Held by a run of scheduled steps (`join`) and by `run_steps`: one at a time, so a second
    /// `join` waits for the steps the first took.
    runs: Mutex<()>,
    /// When each lost worker was last tried ([`Coordinator::rejoin`]).
    tried: Mutex<HashMap<usize, Instant>>,
}

impl Coordinator {
    fn connect(s: &ParameterServerStrategy) -> Result<Coordinator> {
        let token = s.token();
        let ps = s.spec.cluster["ps"]
            .iter()
            .map(|a| connect(a, &token, s.timeout).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        let worker_addrs = s.spec.cluster["worker"].clone();
        let workers = worker_addrs
            .iter()
            .map(|a| connect(a, &token, s.timeout).map(|c| Mutex::new(Some(c))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Coordinator {
            workers,
            worker_addrs,
            ps,
            layout: Mutex::new(Vec::new()),
            rules: Mutex::new(Vec::new()),
            partitioner: s.partitioner,
            token,
            timeout: s.timeout,
            schedule: Mutex::new(Schedule::default()),
            runs: Mutex::new(()),
            tried: Mutex::new(HashMap::new()),
        })
    }

    /// Workers still alive.
    pub fn num_workers(&self) -> usize {
        self.workers.iter().filter(|w| w.lock().is_some()).count()
    }

    /// Create an f32 variable, sharded across the ps tasks by the partitioner, updated with SGD
    /// at learning rate `lr` as gradients arrive.
    pub fn create_variable(&self, name: &str, initial: &[f32], lr: f32) -> Result<VariableId> {
        self.create_variable_with(name, initial.to_vec().into(), sgd(lr), None)
    }

    /// [`Coordinator::create_variable`] in `shards` shards (1 to its elements; a partitioner
    /// of the caller's own, such as TensorFlow's callables).
    pub fn create_variable_sharded(
        &self,
        name: &str,
        initial: &[f32],
        lr: f32,
        shards: usize,
    ) -> Result<VariableId> {
        self.create_variable_with(name, initial.to_vec().into(), sgd(lr), Some(shards))
    }

    /// Create a variable of `initial`'s dtype, updated with `rule` as gradients arrive (but
    /// those a step pushes with a rule of its own, [`StepContext::push`]); in `shards` shards
    /// (1 to its elements), or as many as the partitioner makes for its bytes.
    pub fn create_variable_with(
        &self,
        name: &str,
        initial: Values,
        rule: Rule,
        shards: Option<usize>,
    ) -> Result<VariableId> {
        rule.check()
            .map_err(|why| Error::config(format!("variable '{name}': {why}")))?;
        let dtype = initial.dtype();
        let n = shards.unwrap_or_else(|| {
            self.partitioner
                .shards_of(initial.len(), dtype.size(), self.ps.len())
        });
        if n == 0 || n > initial.len().max(1) {
            return Err(Error::config(format!(
                "variable '{name}': {n} shards for {} elements (1 to the elements)",
                initial.len()
            )));
        }
        let mut layout = self.layout.lock();
        let var = layout.len() as u32;
        let words: usize = layout.iter().map(|v| 1 + 5 * v.len()).sum();
        if n <= MAX_VARIABLE_SHARDS && 4 * (1 + words + 1 + 5 * n) as u64 > MAX_LAYOUT {
            return Err(Error::config(format!(
                "variable '{name}': {n} more shards would take the job's layout past the \
                 {MAX_LAYOUT} bytes a worker takes; use a partitioner that makes fewer"
            )));
        }
        if n > MAX_VARIABLE_SHARDS {
            return Err(Error::config(format!(
                "variable '{name}': {n} shards, more than the {MAX_VARIABLE_SHARDS} a variable \
                 may have; use a partitioner that makes fewer"
            )));
        }
        let mut shards = Vec::with_capacity(n);
        for i in 0..n {
            let r = crate::algorithm::partition(initial.len(), n, i);
            // A layout carries a shard's length as a u32: a longer one would be cut silently.
            if r.len() as u64 > MAX_SHARD {
                return Err(Error::config(format!(
                    "variable '{name}': a shard of {} elements, more than the {MAX_SHARD} a \
                     shard may hold; use a partitioner that makes more shards",
                    r.len()
                )));
            }
            shards.push(Shard {
                ps: (var as usize + i) % self.ps.len(),
                var,
                index: i as u32,
                len: r.len(),
                dtype,
            });
        }
        self.set_shards(&shards, &rule, &initial, &format!(" (creating '{name}')"))?;
        layout.push(shards);
        self.rules.lock().push(rule);
        let setup = encode_layout(&layout);
        for (i, w) in self.workers.iter().enumerate() {
            let mut w = w.lock();
            if let Some(c) = w.as_mut() {
                if let Err(e) = call(c, OP_SETUP, &setup, &format!("worker {i}")) {
                    // Like a worker lost during a step: it rejoins, with the whole layout, when
                    // it answers again.
                    log::warn!(
                        "parameter-server job: worker {i} lost ({e}); it rejoins when it is back"
                    );
                    *w = None;
                }
            }
        }
        Ok(VariableId(var as usize))
    }

    /// Send each shard its part of `values` (with `rule`): CREATE holds a new shard, or sets one
    /// held, keeping its slots.
    fn set_shards(&self, shards: &[Shard], rule: &Rule, values: &Values, what: &str) -> Result<()> {
        let size = values.dtype().size();
        self.to_shards(shards, OP_CREATE, what, |s, part| {
            let mut req = Vec::with_capacity(CREATE_FIXED + s.len * size);
            for v in [s.var, s.index, values.dtype() as u32] {
                req.extend_from_slice(&v.to_le_bytes());
            }
            encode_rule(rule, 0, &mut req);
            req.extend_from_slice(&values.as_bytes()[part.start * size..part.end * size]);
            req
        })
    }

    /// Send each of a variable's `shards` one request of `op`, made by `request` from the shard
    /// and the range of the variable's elements it holds (`what` follows the task's name in an
    /// error).
    fn to_shards(
        &self,
        shards: &[Shard],
        op: u32,
        what: &str,
        mut request: impl FnMut(&Shard, std::ops::Range<usize>) -> Vec<u8>,
    ) -> Result<()> {
        let mut at = 0;
        for s in shards {
            let req = request(s, at..at + s.len);
            at += s.len;
            call(
                &mut self.ps[s.ps].lock(),
                op,
                &req,
                &format!("ps task {}{what}", s.ps),
            )?;
        }
        Ok(())
    }

    /// Set an f32 variable to `values`: [`Coordinator::assign_values`].
    pub fn assign_variable(&self, id: VariableId, values: &[f32]) -> Result<()> {
        self.assign_values(id, values.to_vec().into())
    }

    /// Set a variable to `values` (of its dtype and length) on its ps tasks: a restored
    /// checkpoint, or a value of the caller's. Its rule's slots stay. Steps running meanwhile
    /// may push onto the old or the new value.
    pub fn assign_values(&self, id: VariableId, values: Values) -> Result<()> {
        let layout = self.layout.lock();
        let shards = shards_of(&layout, id, &values, "assign_variable")?;
        let rule = self.rules.lock()[id.0];
        self.set_shards(shards, &rule, &values, "")
    }

    /// Step a variable on its ps tasks by `grad` (of its dtype and length) from the
    /// coordinator, with a rule and the key of its slots (`None`: the variable's own rule), as
    /// a step's push does: an optimizer applied there, or an `assign_sub` that loses none of
    /// the steps pushed meanwhile (each shard takes it as it takes theirs).
    pub fn push_values(
        &self,
        id: VariableId,
        grad: Values,
        rule: Option<(Rule, u64)>,
    ) -> Result<()> {
        if let Some((r, _)) = &rule {
            r.check()
                .map_err(|why| Error::config(format!("push to variable {}: {why}", id.0)))?;
        }
        let layout = self.layout.lock();
        let shards = shards_of(&layout, id, &grad, "push")?;
        let size = grad.dtype().size();
        self.to_shards(shards, OP_PUSH, "", |s, part| {
            push_request(
                s,
                rule,
                &grad.as_bytes()[part.start * size..part.end * size],
            )
        })
    }

    /// The state of an update rule for variable `id`, its shards' joined (so that it sets
    /// again onto any number of ps tasks): the variable's own rule's (`rule` `None`), or that
    /// of the pushes naming `rule` and its key. Zeros where the rule has not stepped it yet.
    /// A checkpoint keeps it with [`SlotState::save`].
    pub fn read_slots(&self, id: VariableId, rule: Option<(Rule, u64)>) -> Result<SlotState> {
        let layout = self.layout.lock();
        let (shards, r) = self.slots_of(&layout, id, rule, "read_slots of")?;
        let mut joined: Option<SlotState> = None;
        for s in shards {
            let due = slots_bytes(&r, s.len, s.dtype);
            let b = call_sized(
                &mut self.ps[s.ps].lock(),
                OP_READ_SLOTS,
                &slots_request(s, rule, &[]),
                &format!("ps task {}", s.ps),
                due,
            )?;
            let part = decode_slots(&r, s.len, s.dtype, &b).map_err(|why| Error::System {
                what: format!("ps task {}", s.ps),
                message: why,
            })?;
            joined = Some(match joined {
                None => part,
                // Every push steps every shard: shard 0's step count stands for all.
                Some(mut j) => {
                    for (a, b) in [(&mut j.first, part.first), (&mut j.second, part.second)] {
                        if let (Some(a), Some(b)) = (a, b) {
                            a.extend(&b);
                        }
                    }
                    j
                }
            });
        }
        let dtype = shards.first().map_or(DType::F32, |s| s.dtype);
        Ok(joined.unwrap_or_else(|| AnySlots::default().export(&r, 0, steps_wide(dtype))))
    }

    /// Variable `id`'s shards in `layout`, and the rule whose slots a slots call names (`None`:
    /// the variable's own; another is checked, `what` naming the call in its error).
    fn slots_of<'a>(
        &self,
        layout: &'a [Vec<Shard>],
        id: VariableId,
        rule: Option<(Rule, u64)>,
        what: &str,
    ) -> Result<(&'a [Shard], Rule)> {
        let shards = layout
            .get(id.0)
            .ok_or_else(|| Error::config(format!("no variable {}", id.0)))?;
        let r = match rule {
            Some((r, _)) => {
                r.check()
                    .map_err(|why| Error::config(format!("{what} variable {}: {why}", id.0)))?;
                r
            }
            None => self.rules.lock()[id.0],
        };
        Ok((shards, r))
    }

    /// Set the state of an update rule for variable `id` (as [`Coordinator::read_slots`]
    /// names it): a restored checkpoint's, onto however many ps tasks hold the variable now.
    /// A state the rule could not have kept for the variable (a slot missing, or of another
    /// length or type) is an error before any shard is set; a ps task that fails part-way
    /// (lost, or keeping too many optimizers' slots) leaves the shards before it set.
    pub fn assign_slots(
        &self,
        id: VariableId,
        rule: Option<(Rule, u64)>,
        state: &SlotState,
    ) -> Result<()> {
        let layout = self.layout.lock();
        let (shards, r) = self.slots_of(&layout, id, rule, "assign_slots to")?;
        let total: usize = shards.iter().map(|s| s.len).sum();
        let dtype = shards.first().map_or(DType::F32, |s| s.dtype);
        AnySlots::default()
            .import(&r, total, steps_wide(dtype), state)
            .map_err(|why| Error::config(format!("assign_slots to variable {}: {why}", id.0)))?;
        self.to_shards(shards, OP_SET_SLOTS, "", |s, part| {
            let cut = |v: &Option<Values>| v.as_ref().map(|v| v.slice(part.start, s.len));
            let state = SlotState {
                first: cut(&state.first),
                second: cut(&state.second),
                steps: state.steps,
            };
            slots_request(s, rule, &encode_slots(&state))
        })
    }

    /// The shard count of each variable.
    pub fn shards(&self) -> Vec<usize> {
        self.layout.lock().iter().map(|s| s.len()).collect()
    }

    /// Read an f32 variable's current value from its ps tasks (another dtype is an error:
    /// read it with [`Coordinator::read_values`]).
    pub fn read_variable(&self, id: VariableId) -> Result<Vec<f32>> {
        match self.read_values(id)? {
            Values::F32(v) => Ok(v),
            v => Err(Error::config(format!(
                "read_variable: variable {} is {}, not f32 (read it with read_values)",
                id.0,
                v.dtype()
            ))),
        }
    }

    /// Read a variable's current value from its ps tasks.
    pub fn read_values(&self, id: VariableId) -> Result<Values> {
        let layout = self.layout.lock();
        let shards = layout
            .get(id.0)
            .ok_or_else(|| Error::config(format!("no variable {}", id.0)))?;
        pull(shards, |ps, req, want| {
            call_sized(
                &mut self.ps[ps].lock(),
                OP_PULL,
                req,
                &format!("ps task {ps}"),
                want,
            )
        })
    }

    /// Run steps `0..n` on the workers, each step on whichever worker is free, and return the
    /// losses in step order.
    ///
    /// - A worker that is lost (its connection breaks, or a step outlives the timeout) is
    ///   dropped and its step given to another; the call fails only when every worker is lost.
    ///   A lost worker that comes back (restarted on its address) rejoins at the next call.
    /// - A step whose step function fails is the caller's error: no further step is
    ///   scheduled, the steps already running finish, and the call returns
    ///   [`Error::StepFailed`] with the step function's message and the worker that raised it.
    ///   The workers stay in the job: the next `run_steps` uses them all.
    /// - A ps task that is gone ends the job: every task still reachable is told, each
    ///   returns [`Error::TaskLost`] naming it from `run_role`, and so does this call.
    pub fn run_steps(&self, n: usize) -> Result<Vec<f32>> {
        if n > MAX_RUN_STEPS {
            return Err(Error::config(format!(
                "run_steps: {n} steps, more than the {MAX_RUN_STEPS} one call may run"
            )));
        }
        let _run = self.runs.lock();
        let (results, outcome) = self.run((0..n as u64).map(|s| (s, Vec::new())).collect());
        outcome?;
        Ok(results
            .into_iter()
            .map(|r| match r {
                Some(Ok(o)) => o.loss,
                _ => f32::NAN,
            })
            .collect())
    }

    /// Schedule a step with `payload` (what its step function reads from
    /// [`StepContext::payload`]) and return at once, TensorFlow's `ClusterCoordinator.schedule`.
    /// Scheduled steps run, each on whichever worker is free, at the next [`Coordinator::join`]
    /// or [`Coordinator::fetch`]; their step numbers count from 0, apart from `run_steps`'.
    pub fn schedule(&self, payload: Vec<u8>) -> Result<RemoteValue> {
        if payload.len() > MAX_STEP_BYTES {
            return Err(Error::config(format!(
                "schedule: a payload of {} bytes, more than the {MAX_STEP_BYTES} a step may carry",
                payload.len()
            )));
        }
        let mut s = self.schedule.lock();
        let step = s.next;
        s.next += 1;
        let slot: Slot = Arc::default();
        s.pending.push((step, payload, slot.clone()));
        Ok(RemoteValue { step, slot })
    }

    /// Run every step scheduled so far, and wait for them, TensorFlow's
    /// `ClusterCoordinator.join`. Failures are as in [`Coordinator::run_steps`]: the first
    /// step function's error (or lost ps task) stops the run and is returned; the steps it
    /// stopped are not run, and their values hold an error saying so.
    pub fn join(&self) -> Result<()> {
        let _run = self.runs.lock();
        let pending = std::mem::take(&mut self.schedule.lock().pending);
        if pending.is_empty() {
            return Ok(());
        }
        let (steps, slots): (Vec<_>, Vec<_>) = pending
            .into_iter()
            .map(|(step, payload, slot)| ((step, payload), slot))
            .unzip();
        let ids: Vec<u64> = steps.iter().map(|s| s.0).collect();
        let (results, outcome) = self.run(steps);
        for ((r, slot), step) in results.into_iter().zip(slots).zip(ids) {
            *slot.lock() = Some(r.unwrap_or_else(|| {
                let why = match &outcome {
                    Err(e) => e.to_string(),
                    Ok(()) => "the run ended first".into(),
                };
                Err(Error::System {
                    what: format!("scheduled step {step}"),
                    message: format!("cancelled, not run: {why}"),
                })
            }));
        }
        outcome
    }

    /// The result of a scheduled step, running what is scheduled first if it has not run
    /// (TensorFlow's `RemoteValue.fetch`): its output, or the error that failed or cancelled it.
    pub fn fetch(&self, value: &RemoteValue) -> Result<StepOutput> {
        if !value.is_ready() {
            // This value's own result is what is returned, whatever stopped the run.
            let _ = self.join();
        }
        value.slot.lock().clone().unwrap_or_else(|| {
            Err(Error::config(format!(
                "scheduled step {} was not scheduled on this coordinator",
                value.step
            )))
        })
    }

    /// Reconnect the lost workers that are back (restarted on their address, or answering
    /// again): they get the variables' layout and take steps again. Every lost worker not tried
    /// within [`REJOIN_WAIT`] is tried once, all at once, for at most that long.
    fn rejoin(&self) {
        let due: Vec<usize> = {
            let mut tried = self.tried.lock();
            let due: Vec<usize> = (0..self.workers.len())
                .filter(|&i| self.workers[i].lock().is_none())
                .filter(|i| tried.get(i).is_none_or(|t| t.elapsed() >= REJOIN_WAIT))
                .collect();
            for &i in &due {
                tried.insert(i, Instant::now());
            }
            due
        };
        if due.is_empty() {
            return;
        }
        let answered: Vec<(usize, TcpStream)> = std::thread::scope(|sc| {
            let probes: Vec<_> = due
                .iter()
                .map(|&i| {
                    sc.spawn(move || {
                        connect_once(
                            &self.worker_addrs[i],
                            &self.token,
                            REJOIN_WAIT,
                            self.timeout,
                        )
                        .ok()
                        .map(|c| (i, c))
                    })
                })
                .collect();
            probes
                .into_iter()
                .filter_map(|p| p.join().ok().flatten())
                .collect()
        });
        // The layout first, then each worker, as `create_variable` takes them.
        let layout = self.layout.lock();
        let setup = encode_layout(&layout);
        for (i, mut c) in answered {
            let mut w = self.workers[i].lock();
            if w.is_some() {
                continue;
            }
            match call(&mut c, OP_SETUP, &setup, &format!("worker {i}")) {
                Ok(_) => {
                    log::info!("parameter-server job: worker {i} is back and rejoins");
                    self.tried.lock().remove(&i);
                    *w = Some(c);
                }
                Err(e) => {
                    log::warn!("parameter-server job: worker {i} answered but did not rejoin: {e}")
                }
            }
        }
    }

    /// Run `steps` (number and payload), each on whichever worker is free: what each gave, in
    /// order (`None`: not run, because the run stopped first), and what stopped the run.
    fn run(&self, steps: Vec<(u64, Vec<u8>)>) -> (Vec<Option<Result<StepOutput>>>, Result<()>) {
        self.rejoin();
        let n = steps.len();
        let queue = Mutex::new((0..n).collect::<VecDeque<usize>>());
        let results: Mutex<Vec<Option<Result<StepOutput>>>> = Mutex::new(vec![None; n]);
        let remaining = std::sync::atomic::AtomicUsize::new(n);
        let lost = Mutex::new(Vec::new());
        // The first step failure or lost ps task; once set, no step is handed out.
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let stop = AtomicBool::new(false);
        let steps = &steps;
        std::thread::scope(|sc| {
            for (i, w) in self.workers.iter().enumerate() {
                let (queue, results, remaining, lost, failure, stop) =
                    (&queue, &results, &remaining, &lost, &failure, &stop);
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
                        let Some(at) = queue.lock().pop_front() else {
                            std::thread::sleep(Duration::from_millis(1));
                            continue;
                        };
                        let (step, payload) = &steps[at];
                        let step = *step;
                        let who = format!("worker {i}");
                        let mut req = step.to_le_bytes().to_vec();
                        req.extend_from_slice(payload);
                        let done = |r: Result<StepOutput>| {
                            results.lock()[at] = Some(r);
                            remaining.fetch_sub(1, Ordering::AcqRel);
                        };
                        match exchange(c, OP_STEP, &req, &who, STEP_ANSWER) {
                            Ok((OP_OK, b)) => {
                                let loss = b[..4].try_into().expect("4 bytes at least");
                                done(Ok(StepOutput {
                                    loss: f32::from_le_bytes(loss),
                                    output: b[4..].to_vec(),
                                }));
                            }
                            Ok((OP_STEP_FAILED, m)) => {
                                let e = Error::StepFailed {
                                    worker: i,
                                    step,
                                    message: String::from_utf8_lossy(&m).into_owned(),
                                };
                                done(Err(e.clone()));
                                fail(e);
                            }
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
                                queue.lock().push_front(at);
                                lost.lock().push((i, e));
                                *conn = None;
                                return;
                            }
                        }
                    }
                });
            }
        });
        let results = results.into_inner();
        if let Some(e) = failure.into_inner() {
            if matches!(e, Error::TaskLost { .. }) {
                self.abort(&e);
            }
            return (results, Err(e));
        }
        let left = remaining.load(Ordering::Acquire);
        if left > 0 {
            let mut why: Vec<String> = lost
                .into_inner()
                .iter()
                .map(|(i, e)| format!("worker {i}: {e}"))
                .collect();
            if why.is_empty() {
                why.push(
                    "no worker is in the job: each was lost earlier and has not come back".into(),
                );
            }
            return (
                results,
                Err(Error::TaskLost {
                    task: "every worker".into(),
                    detail: format!("{} steps left; {}", left, why.join("; ")),
                }),
            );
        }
        (results, Ok(()))
    }

    /// End the job because of `lost`: every task still reachable returns it from `run_role`.
    fn abort(&self, lost: &Error) {
        let reason = encode_lost(lost);
        for (i, w) in self.workers.iter().enumerate() {
            if let Some(c) = w.lock().as_mut() {
                let _ = exchange(c, OP_ABORT, &reason, &format!("worker {i}"), 0..=0);
            }
        }
        for (i, p) in self.ps.iter().enumerate() {
            let _ = exchange(
                &mut p.lock(),
                OP_ABORT,
                &reason,
                &format!("ps task {i}"),
                0..=0,
            );
        }
    }

    /// Tell every task the job is over.
    /// Workers lost earlier are told too where they answer (one attempt each, all at once).
    /// The first ps task that could not be told is the error, once every task was tried.
    /// Through a shared coordinator (a scope's, a variable's), call it once: afterwards every
    /// call that reaches a task fails, its connection closed.
    pub fn shutdown(&self) -> Result<()> {
        let this = self;
        std::thread::scope(|sc| {
            for (i, w) in this.workers.iter().enumerate() {
                sc.spawn(move || {
                    let mut w = w.lock();
                    let who = format!("worker {i}");
                    match w.as_mut() {
                        Some(c) => {
                            let _ = call(c, OP_SHUTDOWN, &[], &who);
                        }
                        None => {
                            let addr = &this.worker_addrs[i];
                            if let Ok(mut c) =
                                connect_once(addr, &this.token, REJOIN_WAIT, this.timeout)
                            {
                                let _ = call(&mut c, OP_SHUTDOWN, &[], &who);
                            }
                        }
                    }
                });
            }
        });
        let mut first = None;
        for (i, p) in self.ps.iter().enumerate() {
            if let Err(e) = call(&mut p.lock(), OP_SHUTDOWN, &[], &format!("ps task {i}")) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
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
        // Fixed and max-size shards may outnumber the ps tasks, never the elements.
        assert_eq!(Partitioner::FixedShards(5).shards(100, 2), 5);
        assert_eq!(Partitioner::FixedShards(5).shards(3, 2), 3);
        assert_eq!(Partitioner::FixedShards(0).shards(3, 2), 1);
        assert_eq!(Partitioner::MaxShardBytes(100).shards(100, 2), 4);
        assert_eq!(Partitioner::MaxShardBytes(400).shards(100, 2), 1);
        assert_eq!(Partitioner::MaxShardBytes(1).shards(3, 2), 3);
        let layout = vec![vec![
            Shard {
                ps: 1,
                var: 0,
                index: 0,
                len: 5,
                dtype: DType::F64,
            },
            Shard {
                ps: 0,
                var: 0,
                index: 1,
                len: 4,
                dtype: DType::F64,
            },
        ]];
        let d = decode_layout(&encode_layout(&layout)).unwrap();
        assert_eq!(d, layout);
        // A shard of a dtype the ps tasks do not hold is refused.
        let mut b = encode_layout(&layout);
        let last = b.len() - 4;
        b[last..].copy_from_slice(&(DType::I32 as u32).to_le_bytes());
        assert!(decode_layout(&b).unwrap_err().contains("not i32"));
        // The partitioners count bytes of the dtype.
        assert_eq!(Partitioner::MaxShardBytes(400).shards_of(100, 8, 2), 2);
        assert_eq!(Partitioner::MinShardBytes(100).shards_of(100, 2, 8), 2);
        // No shard past the bytes (but one element), in whole elements.
        assert_eq!(Partitioner::MaxShardBytes(12).shards_of(3, 8, 2), 3);
        assert_eq!(Partitioner::MaxShardBytes(4).shards_of(3, 8, 2), 3);
    }

    /// A ps task served on a thread, and its address.
    fn ps_task() -> (std::thread::JoinHandle<Result<()>>, String) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let a = addr.clone();
        let t = std::thread::spawn(move || {
            serve_on(
                l,
                &a,
                "tok",
                Duration::from_secs(20),
                Arc::new(PsState::default()),
                None,
            )
        });
        (t, addr)
    }

    /// Send `op` with a payload of `len` bytes announced but only `payload` sent; the answer.
    fn raw(addr: &str, op: u32, len: u64, payload: &[u8]) -> std::io::Result<(u32, Vec<u8>)> {
        let mut c = connect(addr, "tok", Duration::from_secs(5)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut m = op.to_le_bytes().to_vec();
        m.extend_from_slice(&len.to_le_bytes());
        m.extend_from_slice(payload);
        c.write_all(&m)?;
        recv(&mut c, |_| Ok(MAX_ERROR))
    }

    #[test]
    fn short_and_oversized_requests_are_errors_not_crashes() {
        let (t, addr) = ps_task();
        // A CREATE shorter than its fixed part.
        let (op, why) = raw(&addr, OP_CREATE, 5, &[1; 5]).unwrap();
        let why = String::from_utf8_lossy(&why);
        assert_eq!(op, OP_ERR, "{why}");
        assert!(why.contains("CREATE request of 5 bytes"), "{why}");
        // A STEP of no bytes.
        let (op, why) = raw(&addr, OP_STEP, 0, &[]).unwrap();
        assert_eq!(op, OP_ERR);
        assert!(String::from_utf8_lossy(&why).contains("STEP request of 0 bytes"));
        // A PULL announcing 4 GiB: refused before anything is allocated or read.
        let (op, why) = raw(&addr, OP_PULL, 1 << 32, &[]).unwrap();
        let why = String::from_utf8_lossy(&why);
        assert_eq!(op, OP_ERR, "{why}");
        assert!(why.contains("more than the 8"), "{why}");
        // A PUSH larger than any shard held.
        let (op, why) = raw(&addr, OP_PUSH, (PUSH_FIXED + 4 * 1000) as u64, &[]).unwrap();
        assert_eq!(op, OP_ERR);
        assert!(String::from_utf8_lossy(&why).contains("more than the 44 it may hold"));
        // The task still serves.
        let mut c = connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        let (op, req) = fuzz::encode(&Request::Create {
            var: 0,
            shard: 0,
            rule: PLAIN,
            values: vec![1.0f32, 2.0].into(),
        });
        call(&mut c, op, &req, "ps task 0").unwrap();
        let v = call_sized(&mut c, OP_PULL, &[0; 8], "ps task 0", 8).unwrap();
        assert_eq!(
            Values::from_bytes(DType::F32, &v),
            Ok(vec![1.0f32, 2.0].into())
        );
        // A pull answered with another length than the shard's is an error naming the task.
        let e = call_sized(&mut c, OP_PULL, &[0; 8], "ps task 0", 12).unwrap_err();
        assert!(
            e.to_string().contains("ps task 0") && e.to_string().contains("8 bytes where 12"),
            "{e}"
        );
        let mut c = connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        call(&mut c, OP_SHUTDOWN, &[], "ps task 0").unwrap();
        t.join().unwrap().unwrap();
    }

    #[test]
    fn a_short_step_answer_is_an_error_naming_the_worker() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let worker = std::thread::spawn(move || {
            let mut a = Acceptor::new(l, "tok", Purpose::Data, "test").unwrap();
            let (mut s, _) = a
                .next(Instant::now() + Duration::from_secs(5))
                .unwrap()
                .unwrap();
            let _ = recv(&mut s, |_| Ok(8));
            // A loss of no bytes.
            send(&mut s, OP_OK, &[]).unwrap();
        });
        let mut c = connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        let e = call(&mut c, OP_STEP, &0u64.to_le_bytes(), "worker 3").unwrap_err();
        assert!(
            e.to_string().contains("worker 3") && e.to_string().contains("0 bytes where 4 to"),
            "{e}"
        );
        worker.join().unwrap();
    }

    #[test]
    fn idle_strangers_do_not_stop_the_coordinator_from_connecting() {
        let (t, addr) = ps_task();
        let strangers = crate::cluster::auth::testing::idle_strangers(addr.parse().unwrap(), 1100);
        assert!(strangers.len() > 1024);
        let mut c = connect(&addr, "tok", Duration::from_secs(8)).unwrap();
        call(&mut c, OP_SHUTDOWN, &[], "ps task 0").unwrap();
        // Connected within its 8 s, below the strangers' 10 s handshake deadline.
        t.join().unwrap().unwrap();
        drop(strangers);
    }

    #[test]
    fn a_ps_task_starts_no_thread_per_stranger() {
        use crate::cluster::auth::testing::{alone, idle_strangers, threads};
        if !alone("strategy::ps::tests::a_ps_task_starts_no_thread_per_stranger") {
            return;
        }
        let (t, addr) = ps_task();
        std::thread::sleep(Duration::from_millis(50));
        let before = threads();
        let strangers = idle_strangers(addr.parse().unwrap(), 300);
        std::thread::sleep(Duration::from_millis(300));
        let during = threads();
        assert!(
            during <= before,
            "{} strangers took {before} threads to {during}",
            strangers.len()
        );
        let mut c = connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        call(&mut c, OP_SHUTDOWN, &[], "ps task 0").unwrap();
        t.join().unwrap().unwrap();
    }

    pub(super) mod fuzz {
        use super::super::*;
        use proptest::prelude::*;

        pub(in crate::strategy::ps) fn encode(r: &Request) -> (u32, Vec<u8>) {
            let words = |w: &[u32]| w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            match r {
                Request::Create {
                    var,
                    shard,
                    rule,
                    values,
                } => {
                    let mut b = words(&[*var, *shard, values.dtype() as u32]);
                    encode_rule(rule, 0, &mut b);
                    b.extend_from_slice(values.as_bytes());
                    (OP_CREATE, b)
                }
                Request::Pull { var, shard } => (OP_PULL, words(&[*var, *shard])),
                Request::Push {
                    var,
                    shard,
                    dtype,
                    rule,
                    grad,
                } => {
                    let s = Shard {
                        ps: 0,
                        var: *var,
                        index: *shard,
                        len: 0,
                        dtype: *dtype,
                    };
                    (OP_PUSH, push_request(&s, *rule, grad))
                }
                Request::Setup(l) => (OP_SETUP, encode_layout(l)),
                Request::Step { step, payload } => {
                    let mut b = step.to_le_bytes().to_vec();
                    b.extend_from_slice(payload);
                    (OP_STEP, b)
                }
                Request::Shutdown => (OP_SHUTDOWN, Vec::new()),
                Request::Abort(e) => (OP_ABORT, encode_lost(e)),
                Request::ReadSlots { var, shard, rule } => {
                    (OP_READ_SLOTS, slots_request(&at(*var, *shard), *rule, &[]))
                }
                Request::SetSlots {
                    var,
                    shard,
                    rule,
                    state,
                } => (OP_SET_SLOTS, slots_request(&at(*var, *shard), *rule, state)),
            }
        }

        /// Shard `index` of variable `var` (what a request names of it).
        fn at(var: u32, index: u32) -> Shard {
            Shard {
                ps: 0,
                var,
                index,
                len: 0,
                dtype: DType::F32,
            }
        }

        fn shard() -> impl Strategy<Value = Shard> {
            (0usize..8, any::<u32>(), any::<u32>(), 0usize..1 << 20).prop_map(
                |(ps, var, index, len)| Shard {
                    ps,
                    var,
                    index,
                    len,
                    dtype: DType::BF16,
                },
            )
        }

        fn request() -> impl Strategy<Value = Request> {
            let vals = proptest::collection::vec(-1e6f64..1e6, 0..16);
            let rule = prop_oneof![
                (1e-3f32..1.0, 0f32..1.0, any::<bool>()).prop_map(|(l, m, n)| Rule::Sgd {
                    learning_rate: l,
                    momentum: m,
                    nesterov: n
                }),
                (1e-3f32..1.0, 0f32..1.0, 0f32..1.0, 1e-9f32..1.0).prop_map(|(l, a, b, e)| {
                    Rule::Adam {
                        learning_rate: l,
                        beta_1: a,
                        beta_2: b,
                        epsilon: e,
                    }
                }),
            ];
            let values = (vals.clone(), 0usize..4).prop_map(|(v, d)| match d {
                0 => Values::F32(v.iter().map(|&x| x as f32).collect()),
                1 => Values::F64(v),
                2 => Values::F16(v.iter().map(|&x| half::f16::from_f64(x)).collect()),
                _ => Values::BF16(v.iter().map(|&x| half::bf16::from_f64(x)).collect()),
            });
            prop_oneof![
                (any::<u32>(), any::<u32>(), rule.clone(), values).prop_map(
                    |(var, shard, rule, values)| Request::Create {
                        var,
                        shard,
                        rule,
                        values
                    }
                ),
                (any::<u32>(), any::<u32>()).prop_map(|(var, shard)| Request::Pull { var, shard }),
                (
                    any::<u32>(),
                    any::<u32>(),
                    proptest::option::of((rule.clone(), any::<u64>())),
                    proptest::collection::vec(any::<u8>(), 0..16)
                )
                    .prop_map(|(var, shard, rule, grad)| Request::Push {
                        var,
                        shard,
                        dtype: DType::F16,
                        rule,
                        grad
                    }),
                proptest::collection::vec(proptest::collection::vec(shard(), 0..4), 0..4)
                    .prop_map(Request::Setup),
                (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..16))
                    .prop_map(|(step, payload)| Request::Step { step, payload }),
                Just(Request::Shutdown),
                (
                    any::<u32>(),
                    any::<u32>(),
                    proptest::option::of((rule.clone(), any::<u64>())),
                )
                    .prop_map(|(var, shard, rule)| Request::ReadSlots {
                        var,
                        shard,
                        rule
                    }),
                (
                    any::<u32>(),
                    any::<u32>(),
                    proptest::option::of((rule.clone(), any::<u64>())),
                    proptest::collection::vec(any::<u8>(), 0..16)
                )
                    .prop_map(|(var, shard, rule, state)| Request::SetSlots {
                        var,
                        shard,
                        rule,
                        state
                    }),
            ]
        }

        proptest! {
            #[test]
            fn any_request_bytes_decode_or_are_refused(
                op in 0u32..10,
                b in proptest::collection::vec(any::<u8>(), 0..96),
                len in 0usize..8,
            ) {
                let _ = Request::decode(op, &b);
                for d in [DType::F32, DType::F64, DType::F16] {
                    let adam = Rule::Adam {
                        learning_rate: 0.1,
                        beta_1: 0.9,
                        beta_2: 0.99,
                        epsilon: 1e-7,
                    };
                    if let Ok(state) = decode_slots(&adam, len, d, &b) {
                        // What decodes re-encodes to the same bytes.
                        prop_assert_eq!(&encode_slots(&state), &b);
                    }
                }
                let _ = request_bound(op, 16);
                if let Ok(l) = decode_layout(&b) {
                    // What decodes re-encodes to the same bytes.
                    prop_assert_eq!(&encode_layout(&l), &b);
                }
                let h: [u8; HEADER] = std::array::from_fn(|i| b.get(i).copied().unwrap_or(0));
                let _ = parse_header(&h);
            }

            #[test]
            fn requests_round_trip_and_mutations_fail_cleanly(
                r in request(),
                edits in proptest::collection::vec((any::<usize>(), 1..=255u8), 0..4),
                cut in 0usize..200,
            ) {
                let (op, mut b) = encode(&r);
                prop_assert!(b.len() as u64 <= request_bound(op, 16).unwrap());
                prop_assert_eq!(Request::decode(op, &b), Ok(r));
                for (i, x) in &edits {
                    if !b.is_empty() {
                        let i = i % b.len();
                        b[i] ^= x;
                    }
                }
                b.truncate(cut);
                if let Ok(Request::Setup(l)) = Request::decode(op, &b) {
                    // A layout never holds more shards than its bytes can carry.
                    let shards: usize = l.iter().map(|s| s.len()).sum();
                    prop_assert!(16 * shards + 4 * l.len() < b.len());
                }
            }
        }
    }
}
