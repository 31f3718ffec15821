//! The cost model by which `auto` chooses an algorithm between processes, and the figures it
//! runs on.
//!
//! Each carrier (shared memory within a host, the network between hosts or over TCP) is
//! described by three figures: the latency of one message ([`Link::latency_us`]), what each
//! further message a rank sends and receives in the same step adds ([`Link::per_message_us`]),
//! and its bandwidth ([`Link::gbytes_per_s`]); a fourth, [`Tuning::reduce_gbytes_per_s`], is
//! how fast a rank reduces. From them the model predicts each candidate algorithm's time for a
//! call of S bytes on P ranks (H hosts of up to L ranks each), with a = latency, o = per
//! message, b = 1/bandwidth, g = 1/reduce rate:
//!
//! | algorithm | predicted time |
//! |---|---|
//! | all-to-all (one step) | a + (P-2)·o + (P-1)·S·(b+g) |
//! | recursive doubling | log2 P'·(a + S·(b+2g)), plus 2a + 2S·b + S·g for the fold (P' the largest power of two ≤ P; each step receives into scratch, then reduces) |
//! | Rabenseifner | 2·log2 P'·a + 2(P'-1)/P'·S·b + (P'-1)/P'·S·g, plus the fold |
//! | ring | 2(P-1)·a + 2(P-1)/P·S·b + (P-1)/P·S·g |
//! | hosts, rings (reduce-scatter within, a ring among hosts for each of M slices, all-gather within) | 2(L-1)·(a_s + S/M·b_s) + (L-1)·S/M·g + the slices' rings on the network's figures with H ranks and M on each link |
//! | hosts, one step (one step within each way, recursive doubling among hosts for each of m slices, m = 1, 2, 4, ... or M, the fastest) | 2·(a_s + (L-2)·o_s) + 2(L-1)·S/m·b_s + (L-1)·S/m·g + the slices' doubling on the network's figures with H ranks and m on each link |
//! | broadcast down a binomial tree | ceil(log2 P)·(a + S·b) |
//! | broadcast around the ring in k chunks | (P-2+k)·(a + S/k·b) |
//!
//! Where the ranks span hosts, each step of an all-reduce is priced on the carrier it crosses
//! (`terms`): a step between ranks of one host on shared memory's figures (the network's where
//! the transport is `tcp`: so too the hierarchy's steps within a host), a step between hosts on
//! the network's, with its bytes multiplied by the ranks of one host that cross at once (they
//! share its one link: `Layout` counts them from the placement) and each of their messages
//! beyond the first costing o, as a further message of one rank does. With H hosts of L ranks
//! numbered host by host (H and L powers of two), the log2 L steps of partners less than L
//! apart stay within hosts (doubling's first, Rabenseifner's smallest halves) and the rest put
//! L ranks on each link; the all-to-all puts L·(P-L) messages on it; the ring one rank's; the
//! hierarchy's rings M ranks' (a leader of each slice), 2(H-1)/H·S in all, its one-step form m
//! ranks'. The fit of `tutti tune` uses the same pricing. Broadcasts are priced on one carrier.
//!
//! Ranks that outnumber their host's cores share them: figures measured with n ranks per host on
//! c cores are scaled by max(1, L/c) / max(1, n/c) for a job with L (every term alike: the
//! predicted times change, not the choice). A compressed call (f32 narrowed on the network)
//! keeps to the ring and the hierarchy above 128 KiB: only they narrow it.
//!
//! The figures come from `TUTTI_TUNING` ([`CostModel`]): unset, the built-in ones (measured on
//! tutti's development machine: see [`Tuning::BUILT_IN`]); a path, a file that `tutti tune`
//! wrote; `measure`, measured when each communicator is made by joining the job (a split keeps
//! its parent's: [`Communicator::measure_tuning`](crate::Communicator::measure_tuning)). Every
//! rank must hold the same figures so that every rank chooses alike: a 16-bit digest of them
//! travels in every call's identity, and a rank whose figures differ fails the call with a
//! `Mismatch` naming the field `cost model (TUTTI_TUNING)`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The figures of one carrier.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// One message's latency (a step of an algorithm), in µs, beyond what every call costs.
    pub latency_us: f64,
    /// What each further message a rank sends and receives in the same step adds, in µs.
    pub per_message_us: f64,
    /// Bandwidth one way, in GB/s (10^9 bytes per second).
    pub gbytes_per_s: f64,
}

impl Link {
    /// What `x` (latencies, further messages, bytes) costs at these figures, in µs, unscaled.
    pub(crate) fn time(&self, x: &[f64; 3]) -> f64 {
        x[0] * self.latency_us + x[1] * self.per_message_us + x[2] / (self.gbytes_per_s * 1e3)
    }
}

/// The figures the cost model runs on (see the module documentation); what `tutti tune`
/// writes, as JSON, and `TUTTI_TUNING` names.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tuning {
    /// The format's version: [`Tuning::VERSION`].
    pub tutti_tuning: u32,
    /// Shared memory between ranks of one host.
    pub shm: Link,
    /// The network: TCP, or MPI's carrier.
    pub net: Link,
    /// How fast one rank sums f32 into a buffer, in GB/s of input.
    pub reduce_gbytes_per_s: f64,
    /// The most ranks on one host when the figures were measured.
    pub ranks_per_host: usize,
    /// The cores of that host.
    pub cores: usize,
}

/// Where `auto`'s figures come from (`TUTTI_TUNING`; see the module documentation).
#[derive(Copy, Clone, Debug, PartialEq, Default)]
pub enum CostModel {
    /// The figures built into tutti ([`Tuning::BUILT_IN`]): `TUTTI_TUNING` unset.
    #[default]
    BuiltIn,
    /// Figures given (a file `tutti tune` wrote: `TUTTI_TUNING=PATH`).
    Figures(Tuning),
    /// Measured when a job's communicator is made (`TUTTI_TUNING=measure`): a few hundred
    /// small and a few dozen 1 MiB messages per rank, agreed by every rank.
    Measure,
}

impl CostModel {
    /// The figures to start from: those given, else the built-in ones.
    pub fn figures(&self) -> Tuning {
        match self {
            CostModel::Figures(t) => *t,
            CostModel::BuiltIn | CostModel::Measure => Tuning::BUILT_IN,
        }
    }
}

/// The largest tuning file tutti reads.
const MAX_FILE_BYTES: u64 = 64 << 10;

/// `TUTTI_TUNING`: unset (the built-in figures), `measure`, or the path of a file `tutti tune`
/// wrote.
pub fn cost_model_from_env() -> Result<CostModel> {
    match std::env::var("TUTTI_TUNING") {
        Err(_) => Ok(CostModel::BuiltIn),
        Ok(v) if v.trim().is_empty() => Ok(CostModel::BuiltIn),
        Ok(v) if v.trim().eq_ignore_ascii_case("measure") => Ok(CostModel::Measure),
        Ok(path) => Tuning::load(std::path::Path::new(&path))
            .map(CostModel::Figures)
            .map_err(|e| Error::config(format!("TUTTI_TUNING: {e}"))),
    }
}

impl Tuning {
    /// The file format's version.
    pub const VERSION: u32 = 1;

    /// Figures measured with `tutti launch -n 4 -- tutti tune` on tutti's development machine
    /// (2 cores, 4 ranks: shared memory, then `--transport tcp` over loopback).
    pub const BUILT_IN: Tuning = Tuning {
        tutti_tuning: Tuning::VERSION,
        shm: Link {
            latency_us: 1.45,
            per_message_us: 2.6,
            gbytes_per_s: 4.4,
        },
        net: Link {
            latency_us: 8.4,
            per_message_us: 17.0,
            gbytes_per_s: 2.1,
        },
        reduce_gbytes_per_s: 12.0,
        ranks_per_host: 4,
        cores: 2,
    };

    /// Read and check a file `tutti tune` wrote.
    pub fn load(path: &std::path::Path) -> std::result::Result<Tuning, String> {
        use std::io::Read;
        let file = std::fs::File::open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        let mut text = String::new();
        file.take(MAX_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(format!(
                "{} is larger than a tuning file ({MAX_FILE_BYTES} bytes at most)",
                path.display()
            ));
        }
        Tuning::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parse and check a tuning file's text.
    pub fn parse(text: &str) -> std::result::Result<Tuning, String> {
        let t: Tuning = serde_json::from_str(text)
            .map_err(|e| format!("not a tuning file written by tutti tune: {e}"))?;
        t.check()?;
        Ok(t)
    }

    /// The error these figures give, if any: each one named.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.tutti_tuning != Tuning::VERSION {
            return Err(format!(
                "tutti_tuning is {}, and this tutti reads version {}: run tutti tune again",
                self.tutti_tuning,
                Tuning::VERSION
            ));
        }
        let positive = |name: &str, v: f64, max: f64| {
            if v.is_finite() && (1e-6..=max).contains(&v) {
                Ok(())
            } else {
                Err(format!(
                    "{name} is {v}: expected a number from 1e-6 to {max}"
                ))
            }
        };
        for (carrier, l) in [("shm", &self.shm), ("net", &self.net)] {
            positive(&format!("{carrier}.latency_us"), l.latency_us, 1e6)?;
            positive(&format!("{carrier}.gbytes_per_s"), l.gbytes_per_s, 1e4)?;
            if !(l.per_message_us.is_finite() && (0.0..=1e6).contains(&l.per_message_us)) {
                return Err(format!(
                    "{carrier}.per_message_us is {}: expected a number from 0 to 1e6",
                    l.per_message_us
                ));
            }
        }
        positive("reduce_gbytes_per_s", self.reduce_gbytes_per_s, 1e4)?;
        if self.ranks_per_host == 0 || self.ranks_per_host > crate::cluster::MAX_WORLD_SIZE {
            return Err(format!(
                "ranks_per_host is {}: expected 1 to {}",
                self.ranks_per_host,
                crate::cluster::MAX_WORLD_SIZE
            ));
        }
        if self.cores == 0 || self.cores > 1 << 16 {
            return Err(format!("cores is {}: expected 1 to 65536", self.cores));
        }
        Ok(())
    }

    /// A 16-bit digest of the figures, carried in every call's identity so that ranks whose
    /// figures differ (and so might choose differently) fail with a `Mismatch`.
    pub(crate) fn digest(&self) -> u16 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        eat(u64::from(self.tutti_tuning));
        for l in [&self.shm, &self.net] {
            eat(l.latency_us.to_bits());
            eat(l.per_message_us.to_bits());
            eat(l.gbytes_per_s.to_bits());
        }
        eat(self.reduce_gbytes_per_s.to_bits());
        eat(self.ranks_per_host as u64);
        eat(self.cores as u64);
        (h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48)) as u16
    }
}

/// The largest all-reduce a compressed call runs uncompressed in one all-to-all step or by
/// recursive doubling (its time is latency, not bytes).
pub(crate) const COMPRESSED_SMALL: usize = 128 << 10;

/// How a world's ranks lie on hosts: computed once per communicator (calls allocate nothing).
///
/// Where the ranks span hosts, a step of a flat algorithm in which several ranks of one host
/// send to ranks of other hosts puts all their bytes through that host's one network link at
/// once; the counts below say how many, per step, on the host where they are most (0: the step
/// stays within hosts).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Hosts.
    pub hosts: usize,
    /// The most ranks on one host.
    pub most: usize,
    /// The fewest ranks on one host: the hierarchy's rings' leaders a host, one for each slice
    /// (its one-step form's, at most).
    pub fewest: usize,
    /// The links between ranks of one host are shared memory (else TCP, as every link is
    /// where the transport is `tcp`).
    pub shm_within: bool,
    /// Recursive doubling and Rabenseifner, the step of partners `v ^ (1 << k)` among the
    /// largest power of two's ranks: ranks of one host whose partner is on another.
    pub doubling: [u32; 32],
    /// The fold of a world that is not a power of two (ranks 2i and 2i+1, one way at a time):
    /// ranks of one host sending across.
    pub fold: u32,
    /// The ring (rank r to r+1): ranks of one host whose successor is on another.
    pub ring: u32,
    /// The one-step all-to-all: messages of one host to ranks of other hosts, L·(P-L).
    pub all_to_all: u64,
}

impl Layout {
    /// The layout of `world` ranks on `hosts` (every rank's host, numbered from 0; `None`: one
    /// host), with shared memory between the ranks of a host.
    pub(crate) fn of(world: usize, hosts: Option<&[usize]>) -> Layout {
        debug_assert!(
            hosts.is_none_or(|h| h.len() == world),
            "a host for every rank"
        );
        let h = match hosts {
            Some(h) if !h.is_empty() && h.len() == world => h,
            _ => {
                return Layout {
                    hosts: 1,
                    most: world.max(1),
                    fewest: world.max(1),
                    shm_within: true,
                    ..Layout::default()
                }
            }
        };
        let n = h.iter().max().map_or(0, |&m| m + 1).max(1);
        let mut per = vec![0u64; n];
        h.iter().for_each(|&x| per[x] += 1);
        let mut count = vec![0u32; n];
        // The most ranks of one host for which `crosses(rank)` holds.
        let mut most_on_a_host = |crosses: &dyn Fn(usize) -> bool| -> u32 {
            count.iter_mut().for_each(|c| *c = 0);
            for r in (0..world).filter(|&r| crosses(r)) {
                count[h[r]] += 1;
            }
            count.iter().copied().max().unwrap_or(0)
        };
        let pof2 = 1usize << (usize::BITS - 1 - world.max(1).leading_zeros());
        let rem = world - pof2;
        // A rank's place among the pof2 ranks that double (as `doubling::all_reduce` places
        // them): the odd rank of each folded pair, then the rest.
        let mut place = vec![usize::MAX; world];
        (0..pof2).for_each(|v| place[if v < rem { 2 * v + 1 } else { v + rem }] = v);
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        let mut doubling = [0u32; 32];
        for (k, d) in doubling
            .iter_mut()
            .enumerate()
            .take(pof2.trailing_zeros() as usize)
        {
            *d =
                most_on_a_host(&|r| place[r] != usize::MAX && h[real(place[r] ^ (1 << k))] != h[r]);
        }
        // One way at a time: the even rank of a pair sends first, the odd one back at the end.
        let fold = most_on_a_host(&|r| r < 2 * rem && r % 2 == 0 && h[r + 1] != h[r]).max(
            most_on_a_host(&|r| r < 2 * rem && r % 2 == 1 && h[r - 1] != h[r]),
        );
        let ring = most_on_a_host(&|r| h[(r + 1) % world] != h[r]);
        let all_to_all = per
            .iter()
            .map(|&l| l * (world as u64 - l))
            .max()
            .unwrap_or(0);
        Layout {
            hosts: n,
            most: per.iter().copied().max().unwrap_or(1).max(1) as usize,
            fewest: per.iter().copied().filter(|&l| l > 0).min().unwrap_or(1) as usize,
            shm_within: true,
            doubling,
            fold,
            ring,
            all_to_all,
        }
    }
}

/// A world as the model sees it (the same on every rank).
#[derive(Copy, Clone, Debug)]
pub(crate) struct Shape {
    pub world: usize,
    pub layout: Layout,
    /// Every link is shared memory (else some, or all, are the network).
    pub all_shm: bool,
}

impl Shape {
    /// Whether the links between ranks of one host (every link, on one host) are shared
    /// memory.
    fn within_shm(&self) -> bool {
        if self.layout.hosts > 1 {
            self.layout.shm_within
        } else {
            self.all_shm
        }
    }
}

/// The all-reduce algorithms `auto` chooses among between processes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum AllReduce {
    AllToAll,
    Doubling,
    Rabenseifner,
    Ring,
    Hosts,
}

impl AllReduce {
    pub(crate) fn name(self) -> &'static str {
        match self {
            AllReduce::AllToAll => "all-to-all",
            AllReduce::Doubling => "recursive-doubling",
            AllReduce::Rabenseifner => "rabenseifner",
            AllReduce::Ring => "ring",
            AllReduce::Hosts => "hosts",
        }
    }

    /// The algorithms of [`Tuning::all_reduce_times`], in its order.
    const ALL: [AllReduce; 5] = [
        AllReduce::AllToAll,
        AllReduce::Doubling,
        AllReduce::Rabenseifner,
        AllReduce::Ring,
        AllReduce::Hosts,
    ];
}

/// One carrier's figures in µs and µs per byte, scaled for the ranks sharing a host's cores.
#[derive(Copy, Clone, Debug)]
struct Costs {
    a: f64,
    o: f64,
    b: f64,
    g: f64,
}

/// What an algorithm's predicted time is made of: how many latencies `a`, further messages
/// `o` and bytes `b` on each carrier, and bytes reduced `g`. The time is their sum weighted by
/// the figures; a fit solves for the figures of one carrier from timed calls.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub(crate) struct Terms {
    /// (a, o, b) on shared memory.
    pub shm: [f64; 3],
    /// (a, o, b) on the network.
    pub net: [f64; 3],
    /// Bytes reduced.
    pub g: f64,
}

impl Terms {
    /// A step of messages of `bytes` each: within hosts (`crossing` 0) on the carrier between
    /// a host's ranks, else over the network with `crossing` ranks of one host sharing its
    /// link: their bytes go through it one after the other, and each message beyond the first
    /// costs a further message's `o`, as it would on one rank.
    fn step(&mut self, within_shm: bool, crossing: u64, messages: f64, bytes: f64) {
        let (c, share) = match crossing {
            0 if within_shm => (&mut self.shm, 1.0),
            0 => (&mut self.net, 1.0),
            n => (&mut self.net, n as f64),
        };
        c[0] += messages;
        c[1] += messages * (share - 1.0);
        c[2] += messages * share * bytes;
    }

    fn time(&self, shm: &Costs, net: &Costs) -> f64 {
        let dot = |x: &[f64; 3], c: &Costs| x[0] * c.a + x[1] * c.o + x[2] * c.b;
        dot(&self.shm, shm) + dot(&self.net, net) + self.g * shm.g
    }
}

/// What `algo` costs for `bytes` on `shape` (the hierarchy: its rings, and None unless the
/// ranks span several hosts with more than one rank on some).
pub(crate) fn terms(algo: AllReduce, shape: &Shape, bytes: usize) -> Option<Terms> {
    let p = shape.world.max(1);
    let (pf, s) = (p as f64, bytes as f64);
    let lay = &shape.layout;
    let within = shape.within_shm();
    let spans = lay.hosts > 1;
    let pof2 = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let (steps, q) = (pof2.trailing_zeros() as usize, pof2 as f64);
    let mut x = Terms::default();
    let fold = |x: &mut Terms| {
        if pof2 < p {
            x.step(within, u64::from(lay.fold), 2.0, s);
            x.g += s;
        }
    };
    match algo {
        AllReduce::AllToAll => {
            // P-1 messages at once: the first a latency, the others o each (across hosts, the
            // L·(P-L) messages on a host's link, where they are more).
            let further = (pf - 2.0).max(0.0);
            let (c, further, sent) = if spans {
                let on_link = lay.all_to_all as f64;
                (&mut x.net, further.max(on_link - 1.0), on_link * s)
            } else if within {
                (&mut x.shm, further, (pf - 1.0) * s)
            } else {
                (&mut x.net, further, (pf - 1.0) * s)
            };
            *c = [1.0, further, sent];
            x.g = (pf - 1.0) * s;
        }
        AllReduce::Doubling => {
            for k in 0..steps {
                x.step(within, u64::from(lay.doubling[k]), 1.0, s);
                x.g += 2.0 * s; // received into scratch, then reduced
            }
            fold(&mut x);
        }
        AllReduce::Rabenseifner => {
            // Halving then doubling: the step of partners 2^k apart moves S·2^k/P' each way.
            for k in 0..steps {
                x.step(
                    within,
                    u64::from(lay.doubling[k]),
                    2.0,
                    s * (1u64 << k) as f64 / q,
                );
            }
            x.g += (q - 1.0) / q * s;
            fold(&mut x);
        }
        AllReduce::Ring => {
            let crossing = if spans { u64::from(lay.ring).max(1) } else { 0 };
            x.step(within, crossing, 2.0 * (pf - 1.0), s / pf);
            x.g = (pf - 1.0) / pf * s;
        }
        AllReduce::Hosts => {
            if !(spans && lay.hosts < p) {
                return None;
            }
            return Some(hosts_terms(shape, bytes, HostsForm::Rings));
        }
    }
    Some(x)
}

/// The hierarchy's two forms (see `algorithm::hosts`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum HostsForm {
    /// Rings within each host and among the hosts, for bandwidth: a slice for each of the
    /// fewest ranks on a host.
    Rings,
    /// One step within each host each way and recursive doubling among the hosts, for
    /// latency, on this many slices (1 to the fewest ranks on a host): fewer leaders put fewer
    /// messages on each host's link, more share the reductions and the bytes within a host.
    OneStep(usize),
}

impl HostsForm {
    /// The form as `tutti perf` and `tutti tune` name what ran or would run, where the fewest
    /// ranks on a host are `fewest`: `hosts/rings`, or `hosts/one-step-N` with N leaders a
    /// host (`hosts/one-step-all`: every rank of the fewest leads one).
    pub(crate) fn name(self, fewest: usize) -> &'static str {
        const LEADERS: [&str; 7] = [
            "hosts/one-step-1",
            "hosts/one-step-2",
            "hosts/one-step-4",
            "hosts/one-step-8",
            "hosts/one-step-16",
            "hosts/one-step-32",
            "hosts/one-step-64",
        ];
        let m = self.slices(fewest);
        match self {
            HostsForm::Rings => "hosts/rings",
            HostsForm::OneStep(_) if m > 1 && m == fewest => "hosts/one-step-all",
            // The model tries powers of two below the fewest, and the fewest.
            HostsForm::OneStep(_) => LEADERS
                .get(m.trailing_zeros() as usize)
                .filter(|_| m.is_power_of_two())
                .copied()
                .unwrap_or("hosts/one-step"),
        }
    }

    /// The slices the form cuts the buffer into where the fewest ranks on a host are `fewest`.
    pub(crate) fn slices(self, fewest: usize) -> usize {
        let fewest = fewest.max(1);
        match self {
            HostsForm::Rings => fewest,
            HostsForm::OneStep(m) => m.clamp(1, fewest),
        }
    }
}

/// What the hierarchy costs in `form`, with H hosts of at most L ranks. Rings, on M slices
/// (the fewest ranks on a host): a ring reduce-scatter and all-gather within each host (L-1
/// steps each of the largest slice, S/M) and each slice's ring among the hosts (2(H-1) steps
/// of S/(M·H), the M leaders of a host on its link at once). One step, on m slices: one step
/// within each host each way (L-1 messages of S/m at once) and recursive doubling among the
/// hosts on each slice (log2 H steps of S/m, the m leaders of a host on its link at once, with
/// a fold where H is no power of two). Where every host has as many ranks the rings run
/// pipelined, the steps within hosts beside those among them; the model adds the two (an upper
/// bound, close where either dominates).
pub(crate) fn hosts_terms(shape: &Shape, bytes: usize, form: HostsForm) -> Terms {
    let lay = &shape.layout;
    let within = shape.within_shm();
    let s = bytes as f64;
    let slices = form.slices(lay.fewest);
    let (l, m, h) = (lay.most.max(1) as f64, slices as f64, lay.hosts.max(1));
    let crossing = slices as u64;
    let mut x = Terms::default();
    if form == HostsForm::Rings {
        x.step(within, 0, 2.0 * (l - 1.0), s / m);
        let hf = h as f64;
        x.step(within, crossing, 2.0 * (hf - 1.0), s / (m * hf));
        x.g = (l - 1.0) * s / m + (hf - 1.0) / hf * s / m;
        return x;
    }
    if lay.most > 1 {
        let c = if within { &mut x.shm } else { &mut x.net };
        *c = [2.0, 2.0 * (l - 2.0).max(0.0), 2.0 * (l - 1.0) * s / m];
    }
    let pof2 = 1usize << (usize::BITS - 1 - h.leading_zeros());
    for _ in 0..pof2.trailing_zeros() {
        x.step(within, crossing, 1.0, s / m);
        x.g += 2.0 * s / m; // received into scratch, then reduced
    }
    if pof2 < h {
        x.step(within, crossing, 2.0, s / m);
        x.g += s / m;
    }
    x.g += (l - 1.0) * s / m;
    x
}

impl Tuning {
    fn costs(&self, link: &Link, ranks_per_host: usize) -> Costs {
        let share = |n: usize| (n as f64 / self.cores as f64).max(1.0);
        let s = share(ranks_per_host) / share(self.ranks_per_host);
        Costs {
            a: link.latency_us * s,
            o: link.per_message_us * s,
            b: s / (link.gbytes_per_s * 1e3),
            g: s / (self.reduce_gbytes_per_s * 1e3),
        }
    }

    /// The predicted time, in µs, of each all-reduce algorithm `auto` may run for `bytes` on
    /// `shape` (infinite where [`terms`] has none); the hierarchy's in the form it would run
    /// (the rings where the call is `compressed`).
    pub(crate) fn all_reduce_times(
        &self,
        shape: &Shape,
        bytes: usize,
        compressed: bool,
    ) -> [(AllReduce, f64); 5] {
        let most = shape.layout.most.max(1);
        let (shm, net) = (self.costs(&self.shm, most), self.costs(&self.net, most));
        AllReduce::ALL.map(|a| {
            let t = match (a, terms(a, shape, bytes)) {
                (_, None) => f64::INFINITY,
                // The hierarchy runs whichever of its forms is predicted faster.
                (AllReduce::Hosts, Some(_)) => self.hosts_form(shape, bytes, compressed).1,
                (_, Some(x)) => x.time(&shm, &net),
            };
            (a, t)
        })
    }

    /// The hierarchy's form predicted fastest (see [`hosts_terms`]), and its time: the rings
    /// (for bandwidth), or one step within each host and recursive doubling among the hosts
    /// (for latency) on 1, 2, 4, ... or M slices (M the fewest ranks on a host); the rings
    /// wherever f32 is narrowed on the network (only they narrow it). Every rank decides
    /// alike, from the same figures and world.
    pub(crate) fn hosts_form(
        &self,
        shape: &Shape,
        bytes: usize,
        compressed: bool,
    ) -> (HostsForm, f64) {
        let most = shape.layout.most.max(1);
        let (shm, net) = (self.costs(&self.shm, most), self.costs(&self.net, most));
        let time = |form| hosts_terms(shape, bytes, form).time(&shm, &net);
        let mut best = (HostsForm::Rings, time(HostsForm::Rings));
        if compressed {
            return best;
        }
        let fewest = shape.layout.fewest.max(1);
        let counts = (0..usize::BITS)
            .map(|k| 1usize << k)
            .take_while(|&m| m < fewest)
            .chain([fewest]);
        for m in counts {
            let t = time(HostsForm::OneStep(m));
            if t < best.1 {
                best = (HostsForm::OneStep(m), t);
            }
        }
        best
    }

    /// The all-reduce algorithm the model predicts fastest (ties to the earlier in
    /// [`Tuning::all_reduce_times`]' order). A `compressed` call (f32 narrowed on the network,
    /// which only the ring does) keeps to the ring and the hierarchy above
    /// [`COMPRESSED_SMALL`], where its time is bytes, and never runs Rabenseifner.
    pub(crate) fn all_reduce(&self, shape: &Shape, bytes: usize, compressed: bool) -> AllReduce {
        let mut best = (AllReduce::Ring, f64::INFINITY);
        for (a, t) in self.all_reduce_times(shape, bytes, compressed) {
            let narrows = matches!(a, AllReduce::Ring | AllReduce::Hosts);
            let latency_bound =
                matches!(a, AllReduce::AllToAll | AllReduce::Doubling) && bytes <= COMPRESSED_SMALL;
            if compressed && !narrows && !latency_bound {
                continue;
            }
            if t < best.1 {
                best = (a, t);
            }
        }
        best.0
    }

    /// Whether a broadcast of `bytes` is predicted faster down a binomial tree than around the
    /// ring in pieces of `chunk` bytes.
    pub(crate) fn tree_broadcast(&self, shape: &Shape, bytes: usize, chunk: usize) -> bool {
        let p = shape.world;
        if p < 3 {
            return false; // the same one message either way
        }
        let most = shape.layout.most.max(1);
        let link = if shape.all_shm { &self.shm } else { &self.net };
        let c = self.costs(link, most);
        let s = bytes as f64;
        let rounds = (usize::BITS - (p - 1).leading_zeros()) as f64;
        let tree = rounds * (c.a + s * c.b);
        let k = bytes.div_ceil(chunk.max(1)).max(1) as f64;
        let ring = (p as f64 - 2.0 + k) * (c.a + s / k * c.b);
        tree < ring
    }
}

/// The all-reduces a fit times: bytes, and repetitions (the median is kept).
pub(crate) const FIT_SIZES: [(usize, usize); 5] = [
    (8, 40),
    (4 << 10, 30),
    (32 << 10, 20),
    (256 << 10, 10),
    (1 << 20, 6),
];

/// The figures that make `auto` run the one-step all-to-all at every size (to time it).
pub(crate) const ALL_TO_ALL: Tuning = Tuning {
    shm: Link {
        latency_us: 1e5,
        per_message_us: 0.0,
        gbytes_per_s: 1e4,
    },
    net: Link {
        latency_us: 1e5,
        per_message_us: 0.0,
        gbytes_per_s: 1e4,
    },
    reduce_gbytes_per_s: 1e4,
    ..Tuning::BUILT_IN
};

/// The most bytes a rank sends in a timed all-to-all ((P-1)·S): larger worlds time it at the
/// smaller sizes only.
pub(crate) const FIT_ALL_TO_ALL_SENT: usize = 8 << 20;

/// The least-squares fit of `rows` (coefficients, time, the time each row's error is relative
/// to: so that 8 bytes weighs as much as 1 MiB), with every figure kept at or above zero (a figure the fit
/// drives below zero is fixed at zero and the rest fitted again).
pub(crate) fn fit(rows: &[([f64; 5], f64, f64)]) -> [f64; 5] {
    let mut free = [true; 5];
    loop {
        let idx: Vec<usize> = (0..5).filter(|&i| free[i]).collect();
        let n = idx.len();
        // The normal equations, each row weighted by 1/t.
        let mut m = vec![vec![0.0f64; n + 1]; n];
        for (x, t, weight) in rows {
            let w = 1.0 / (weight * weight);
            for (i, &ii) in idx.iter().enumerate() {
                for (j, &jj) in idx.iter().enumerate() {
                    m[i][j] += w * x[ii] * x[jj];
                }
                m[i][n] += w * x[ii] * t;
            }
        }
        // Gaussian elimination with partial pivoting; a singular column is left at zero.
        let mut sol = vec![0.0f64; n];
        for c in 0..n {
            let piv = (c..n)
                .max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))
                .unwrap_or(c);
            m.swap(c, piv);
            if m[c][c].abs() < 1e-30 {
                continue;
            }
            let pivot = m[c].clone();
            for (r, row) in m.iter_mut().enumerate() {
                if r != c {
                    let f = row[c] / pivot[c];
                    row.iter_mut()
                        .zip(&pivot)
                        .skip(c)
                        .for_each(|(x, p)| *x -= f * p);
                }
            }
        }
        for c in 0..n {
            if m[c][c].abs() >= 1e-30 {
                sol[c] = m[c][n] / m[c][c];
            }
        }
        let mut out = [0.0f64; 5];
        idx.iter().zip(&sol).for_each(|(&i, &v)| out[i] = v);
        match idx
            .iter()
            .zip(&sol)
            .find(|(_, &v)| v < 0.0 || !v.is_finite())
        {
            Some((&i, _)) => free[i] = false,
            None => return out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(world: usize, all_shm: bool) -> Shape {
        Shape {
            world,
            layout: Layout::of(world, None),
            all_shm,
        }
    }

    #[test]
    fn the_built_in_figures_are_valid_and_round_trip() {
        Tuning::BUILT_IN.check().unwrap();
        let text = serde_json::to_string(&Tuning::BUILT_IN).unwrap();
        assert_eq!(Tuning::parse(&text).unwrap(), Tuning::BUILT_IN);
    }

    #[test]
    fn bad_files_name_the_field() {
        let mut t = Tuning::BUILT_IN;
        t.net.gbytes_per_s = -1.0;
        let e = Tuning::parse(&serde_json::to_string(&t).unwrap()).unwrap_err();
        assert!(e.contains("net.gbytes_per_s"), "{e}");
        let mut t = Tuning::BUILT_IN;
        t.tutti_tuning = 9;
        let e = Tuning::parse(&serde_json::to_string(&t).unwrap()).unwrap_err();
        assert!(e.contains("tutti_tuning is 9"), "{e}");
        let e = Tuning::parse("{\"shm\": 1}").unwrap_err();
        assert!(e.contains("not a tuning file"), "{e}");
        let mut t = Tuning::BUILT_IN;
        t.cores = 0;
        assert!(Tuning::parse(&serde_json::to_string(&t).unwrap())
            .unwrap_err()
            .contains("cores is 0"));
    }

    #[test]
    fn the_digest_tells_figures_apart() {
        let mut t = Tuning::BUILT_IN;
        assert_eq!(t.digest(), Tuning::BUILT_IN.digest());
        t.shm.latency_us += 0.5;
        assert_ne!(t.digest(), Tuning::BUILT_IN.digest());
    }

    /// The fit recovers figures from times the model itself predicts.
    #[test]
    fn the_fit_recovers_the_figures() {
        let truth = [3.0, 2.0, 1.5, 2e-4, 1e-4];
        let mut rows = Vec::new();
        for p in [4, 5] {
            for algo in [
                AllReduce::AllToAll,
                AllReduce::Doubling,
                AllReduce::Rabenseifner,
                AllReduce::Ring,
            ] {
                for (bytes, _) in FIT_SIZES {
                    let t = terms(algo, &shape(p, true), bytes).unwrap();
                    let x = [1.0, t.shm[0], t.shm[1], t.shm[2], t.g];
                    let t: f64 = x.iter().zip(truth).map(|(x, v)| x * v).sum();
                    rows.push((x, t, t));
                }
            }
        }
        let got = fit(&rows);
        for (g, t) in got.iter().zip(truth) {
            assert!(
                (g - t).abs() <= 1e-6 * t.max(1.0),
                "{got:?} against {truth:?}"
            );
        }
        // A figure the times cannot support comes out as zero, not below.
        let rows: Vec<_> = rows
            .iter()
            .map(|(x, t, _)| (*x, t * 0.5 - 5.0, *t))
            .collect();
        assert!(fit(&rows).iter().all(|v| *v >= 0.0));
    }

    /// The built-in figures reproduce the crossovers measured on the development machine
    /// (README, "Where auto changes algorithm"): where one algorithm was clearly the faster,
    /// the model chooses it.
    #[test]
    fn the_built_in_model_chooses_what_was_measured_fastest() {
        let t = Tuning::BUILT_IN;
        let k = 1024;
        // (all shared memory, ranks, bytes, the algorithms measured fastest: within the
        // noise of one another), from `tutti launch -n P -- tutti perf -a ALGO` (4 processes
        // on 2 cores, µs, two runs each: README, "Where auto changes algorithm").
        use AllReduce::*;
        let cases: [(bool, usize, usize, &[AllReduce]); 10] = [
            // shm 8 B: doubling 5.4-6.8, all-to-all 6.1, Rabenseifner 8.4-9.6, ring 8.8-9.6
            (true, 4, 8, &[Doubling, AllToAll]),
            // shm 4 KiB: doubling 6.5-6.7, Rabenseifner 9.1-14.7, all-to-all 9.1-10.4, ring 12-16
            (true, 4, 4 * k, &[Doubling]),
            // shm 256 KiB: Rabenseifner 103-107, ring 123-131, doubling 210-218, all-to-all 330-400
            (true, 4, 256 * k, &[Rabenseifner]),
            // tcp 8 B: doubling 21, all-to-all 29-32, Rabenseifner 32-40, ring 38-53
            (false, 4, 8, &[Doubling]),
            // tcp 4 KiB: doubling 20-24, all-to-all 35-39, Rabenseifner 38-41, ring 76-101
            (false, 4, 4 * k, &[Doubling]),
            // tcp 32 KiB: doubling 42-50, Rabenseifner 54-56, all-to-all 79-80, ring 99-124
            (false, 4, 32 * k, &[Doubling, Rabenseifner]),
            // tcp 256 KiB: Rabenseifner 212-224, doubling 238-250, ring 355-376, all-to-all 440-529
            (false, 4, 256 * k, &[Rabenseifner, Doubling]),
            // 2 processes over shared memory (README table): all-to-all 1.9 against the
            // ring's 2.9 at 16 KiB; the ring 10 against 16 at 256 KiB
            (true, 2, 16 * k, &[AllToAll, Doubling]),
            (true, 2, 256 * k, &[Ring, Rabenseifner]),
            // 8 processes over TCP, 8 B: doubling 125-183 against the all-to-all's 210-279
            (false, 8, 8, &[Doubling]),
        ];
        for (shm, p, bytes, want) in cases {
            let got = t.all_reduce(&shape(p, shm), bytes, false);
            let times = t.all_reduce_times(&shape(p, shm), bytes, false);
            assert!(
                want.contains(&got),
                "{} P={p} {bytes} B: chose {}, measured fastest {want:?} ({times:?})",
                if shm { "shm" } else { "tcp" },
                got.name(),
            );
        }
        // Broadcast: the tree at 8 ranks for small buffers, the ring's pipeline for large.
        assert!(t.tree_broadcast(&shape(8, false), 8, 256 * k));
        assert!(t.tree_broadcast(&shape(8, true), 32 * k, 256 * k));
        assert!(!t.tree_broadcast(&shape(8, false), 64 << 20, 256 * k));
        assert!(!t.tree_broadcast(&shape(2, true), 8, 256 * k));
    }

    /// Across hosts over a slow network the hierarchy pays for large buffers; over a network
    /// as fast as memory it need not.
    #[test]
    fn the_hierarchy_wins_where_the_network_is_the_bottleneck() {
        let hosts = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3];
        let shape = Shape {
            world: 16,
            layout: Layout::of(16, Some(&hosts)),
            all_shm: false,
        };
        let mut t = Tuning::BUILT_IN;
        t.cores = 16;
        t.net.gbytes_per_s = 0.125; // 1 Gbit/s
        assert_eq!(t.all_reduce(&shape, 64 << 20, false), AllReduce::Hosts);
        // For 8 bytes, one leader a host: the flat doubling's steps between hosts put a
        // host's 4 ranks' messages on its link at once, each beyond the first a further
        // message's cost (on 4 simulated hosts of 4 ranks: 68-111 µs against doubling's
        // 122-145 and 211-228 with a leader for each of 4 slices; README, "A simulated
        // cluster").
        assert_eq!(t.all_reduce(&shape, 8, false), AllReduce::Hosts);
        assert_eq!(t.hosts_form(&shape, 8, false).0, HostsForm::OneStep(1));
        // As `tutti perf` names what ran.
        assert_eq!(HostsForm::OneStep(1).name(4), "hosts/one-step-1");
        assert_eq!(HostsForm::OneStep(2).name(4), "hosts/one-step-2");
        assert_eq!(HostsForm::OneStep(4).name(4), "hosts/one-step-all");
        assert_eq!(HostsForm::OneStep(3).name(3), "hosts/one-step-all");
        assert_eq!(HostsForm::OneStep(8).name(3), "hosts/one-step-all");
        assert_eq!(HostsForm::OneStep(1).name(1), "hosts/one-step-1");
        assert_eq!(HostsForm::Rings.name(4), "hosts/rings");
        let x = terms(AllReduce::Doubling, &shape, 8).unwrap();
        assert_eq!((x.net[0], x.net[1]), (2.0, 6.0));
        let x = hosts_terms(&shape, 8, HostsForm::OneStep(4));
        assert_eq!((x.net[0], x.net[1]), (2.0, 6.0));
        let x = hosts_terms(&shape, 8, HostsForm::OneStep(1));
        assert_eq!((x.net[0], x.net[1]), (2.0, 0.0));
        // The hierarchy's rings for bandwidth; for latency, one step within each host and
        // doubling among the hosts, whose 4 KiB crosses each link as one buffer a step where
        // the flat doubling puts the host's 4 ranks' buffers on it (as measured on 4 simulated
        // hosts of 4 ranks behind 1 Gbit/s links: README, "A simulated cluster").
        assert_eq!(t.hosts_form(&shape, 64 << 20, false).0, HostsForm::Rings);
        let (form, time) = t.hosts_form(&shape, 4096, false);
        assert!(matches!(form, HostsForm::OneStep(_)), "{form:?}");
        assert_eq!(
            t.hosts_form(&shape, 4096, true).0,
            HostsForm::Rings,
            "only the rings narrow f32"
        );
        assert_eq!(t.all_reduce(&shape, 4096, false), AllReduce::Hosts);
        let times = t.all_reduce_times(&shape, 4096, false);
        let (shm, net) = (t.costs(&t.shm, 4), t.costs(&t.net, 4));
        assert_eq!(times[4].1, hosts_terms(&shape, 4096, form).time(&shm, &net));
        assert_eq!(times[4].1, time);
        // On one host the hierarchy does not apply, in either form, whatever the figures (a
        // shared-memory message that costs no more than the first, as `tutti tune` can fit,
        // once made its one-step form the cheapest there).
        let one_host = Shape {
            world: 4,
            layout: Layout::of(4, None),
            all_shm: true,
        };
        let mut free = Tuning::BUILT_IN;
        free.shm.per_message_us = 0.0;
        for bytes in [8, 4096, 1 << 20] {
            assert_eq!(
                free.all_reduce_times(&one_host, bytes, false)[4].1,
                f64::INFINITY
            );
            assert_ne!(free.all_reduce(&one_host, bytes, false), AllReduce::Hosts);
        }
        // Compressed: never Rabenseifner (which sends f32); the ring or the hierarchy for
        // large buffers.
        let one_per_host: Vec<usize> = (0..8).collect();
        let flat = Shape {
            world: 8,
            layout: Layout::of(8, Some(&one_per_host)),
            all_shm: false,
        };
        assert_eq!(
            t.all_reduce(&flat, 64 << 20, false),
            AllReduce::Rabenseifner
        );
        assert_eq!(t.all_reduce(&flat, 64 << 20, true), AllReduce::Ring);
        assert_eq!(t.all_reduce(&flat, 8, true), AllReduce::Doubling);
    }

    /// Figures `tutti tune` measured on 2 simulated hosts of 2 ranks behind 4 Gbit/s links
    /// (`tests/multiprocess.rs` runs the hierarchy with them): the one-step form with one
    /// leader a host for small buffers, with two for mid sizes (the bytes within a host and
    /// the reductions shared), the rings for large ones.
    #[test]
    fn the_one_step_form_takes_as_many_leaders_as_pay() {
        let t = Tuning::parse(include_str!("../tests/data/tuning-2hosts-4gbit.json")).unwrap();
        let shape = Shape {
            world: 4,
            layout: Layout::of(4, Some(&[0, 0, 1, 1])),
            all_shm: false,
        };
        let form = |bytes| t.hosts_form(&shape, bytes, false).0;
        assert_eq!(form(4), HostsForm::OneStep(1));
        assert_eq!(form(4000), HostsForm::OneStep(1));
        assert_eq!(form(4 * 8191), HostsForm::OneStep(2));
        assert_eq!(form(4 * 30011), HostsForm::OneStep(2));
        assert_eq!(form(4 * 70001), HostsForm::Rings);
        assert_eq!(t.all_reduce(&shape, 4000, false), AllReduce::Hosts);
        // A compressed call runs the rings (only they narrow f32), and is priced as them: for
        // 8 bytes recursive doubling, not the rings' 2(L-1) + 2(H-1) steps.
        let b = Tuning::BUILT_IN;
        assert_eq!(b.all_reduce(&shape, 8, false), AllReduce::Hosts);
        assert_eq!(b.all_reduce(&shape, 8, true), AllReduce::Doubling);
    }

    /// Where the ranks of one host cross to other hosts at once, the layout counts them: a
    /// step of recursive doubling or Rabenseifner between hosts puts every rank of a host on
    /// its link, the ring one.
    #[test]
    fn the_layout_counts_the_ranks_that_share_a_host_s_link() {
        let hosts: Vec<usize> = (0..16).map(|r| r / 4).collect();
        let l = Layout::of(16, Some(&hosts));
        assert_eq!((l.hosts, l.most, l.ring, l.all_to_all), (4, 4, 1, 48));
        assert_eq!(l.doubling[..5], [0, 0, 4, 4, 0]);
        // 6 ranks on 2 hosts of 3: the pairs (0, 1) and (2, 3) fold, the second across
        // hosts. Ranks 1, 3, 4 and 5 (hosts 0, 1, 1, 1) double: 1 with 3, then 1 with 4, one
        // rank of each host across at each step.
        let hosts = [0, 0, 0, 1, 1, 1];
        let l = Layout::of(6, Some(&hosts));
        assert_eq!((l.fold, l.ring), (1, 1));
        assert_eq!(l.doubling[..3], [1, 1, 0]);
        // The fold goes one way at a time: host 1 sends one message out (2 to 3) and takes
        // one in (0 to 1), never two at once.
        assert_eq!(Layout::of(6, Some(&[0, 1, 1, 2, 2, 2])).fold, 1);
        // One host: nothing crosses.
        let l = Layout::of(8, None);
        assert_eq!(
            (l.doubling, l.fold, l.ring, l.all_to_all),
            ([0; 32], 0, 0, 0)
        );
    }

    /// On 2 hosts of 2 ranks behind shaped links (README, "A simulated cluster": the network
    /// fitted at 0.63 GB/s), Rabenseifner puts both ranks of a host on its link at once and was
    /// the slowest at 256 KiB (1.1 ms against the hierarchy's 0.5): the model no longer
    /// chooses it there, and predicts it slower than the ring.
    #[test]
    fn flat_algorithms_pay_for_the_ranks_sharing_a_host_s_link() {
        let hosts = [0, 0, 1, 1];
        let shape = Shape {
            world: 4,
            layout: Layout::of(4, Some(&hosts)),
            all_shm: false,
        };
        let mut t = Tuning::BUILT_IN;
        t.net.gbytes_per_s = 0.63;
        let k = 1024;
        for bytes in [256 * k, 2048 * k, 16384 * k] {
            assert_eq!(
                t.all_reduce(&shape, bytes, false),
                AllReduce::Hosts,
                "{bytes}"
            );
            let times = t.all_reduce_times(&shape, bytes, false);
            let of = |a: AllReduce| times.iter().find(|(x, _)| *x == a).unwrap().1;
            assert!(
                of(AllReduce::Rabenseifner) > of(AllReduce::Ring),
                "{times:?}"
            );
        }
        // Steps within a host run on shared memory: doubling's first step costs what it costs
        // there.
        let x = terms(AllReduce::Doubling, &shape, 8).unwrap();
        assert_eq!((x.shm[0], x.net[0]), (1.0, 1.0));
        // Over TCP everywhere (no shared memory within hosts) every step is the network's.
        let tcp = Shape {
            layout: Layout {
                shm_within: false,
                ..shape.layout
            },
            ..shape
        };
        let x = terms(AllReduce::Doubling, &tcp, 8).unwrap();
        assert_eq!((x.shm[0], x.net[0]), (0.0, 2.0));
    }
}
