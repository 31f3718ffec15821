//! `Communicator::split`: MPI_Comm_split's contract. Every rank of the parent calls it with a
//! color and a key; the ranks of one color form a new communicator, ranked by key, then by
//! parent rank. It is collective over the parent (its checks and timeout): the colors and keys
//! travel in one all-gather, and between processes each group's listening addresses in a
//! second; each group then meets over transports of its own (new connections proving the
//! job's token, or a new group of threads; for a group of one process's devices, an engine over
//! its members' devices too), so that its calls never disturb another group's or the parent's.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use super::Communicator;
use crate::cluster::store::Store;
use crate::config::Config;
use crate::engine::GroupEngine;
use crate::error::{Error, Result};
use crate::transport::local::LocalTransport;
use crate::transport::net::{Meeting, NetTransport};
use crate::transport::{Regroup, Transport};

/// Bytes of a rank's listening record in the address all-gather (host, port, world, kind and
/// host identity; a host name is at most 255 bytes).
const RECORD: usize = 512;

/// One group of a split of threads: its parent group, the split's number, its color.
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
struct Pending {
    group: usize,
    number: u64,
    color: u32,
}

/// A group's engine (a split of a group of devices), or why it could not be made.
type SubEngine = Result<Arc<dyn GroupEngine>>;

/// What the members of a group of threads take, until each has taken its part.
struct Taken {
    slots: Vec<Option<LocalTransport>>,
    engine: Option<SubEngine>,
    /// Past this, no member is still coming (see `take_local`); `None`: a timeout too long to
    /// count.
    until: Option<std::time::Instant>,
}

/// The groups of threads being split in this process, until each member has taken its
/// transport.
static PENDING: Mutex<Option<HashMap<Pending, Taken>>> = Mutex::new(None);

impl Communicator {
    /// Split this communicator: the ranks that pass the same `color` form a new communicator,
    /// ranked by `key`, then by rank in this one; a rank that passes `None` takes part but gets
    /// no communicator (as MPI_Comm_split's `MPI_UNDEFINED`). Collective: every rank calls it,
    /// in the same order as its other calls; it is checked and bounded by the timeout like
    /// them. The new communicator has this one's settings (timeout, algorithm, chunk size,
    /// modes) and a transport of its own. Splits of splits are splits like any other.
    ///
    /// A group of one process's XLA devices splits into groups over their members' devices
    /// (each rank keeps its device; each group's programs span its devices only). A job of one
    /// GPU per process, and in-process GPU groups, cannot be split yet: the error says so.
    ///
    /// ```
    /// use tutti::{run_local, Config, ReduceOp};
    /// let sums = run_local(4, &Config::default(), |comm| {
    ///     let half = comm.split(Some((comm.rank() % 2) as u32), 0).unwrap().unwrap();
    ///     let mut v = [comm.rank() as i32];
    ///     half.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    ///     (half.rank(), half.world_size(), v[0])
    /// })
    /// .unwrap();
    /// assert_eq!(sums, [(0, 2, 2), (0, 2, 4), (1, 2, 2), (1, 2, 4)]);
    /// ```
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let shared = self.progress.shared();
        let engine = shared.engine.clone();
        let regroup = match shared.transport.regroup() {
            // A group of devices splits as its threads do, each group with an engine of its
            // own over its members' devices.
            Some(r @ Regroup::Threads(_)) => {
                // Refused before the ranks meet where the engine cannot, as every rank of the
                // group refuses it.
                if let Some(Err(why)) = engine.as_ref().map(|e| e.splits()) {
                    return Err(Error::Unavailable {
                        what: format!("split of {} ranks", self.device_spec()),
                        why,
                    });
                }
                r
            }
            Some(r) if engine.is_none() => r,
            _ => {
                return Err(Error::Unavailable {
                    what: format!("split of {} ranks", self.device_spec()),
                    why: "a job of one GPU per process cannot be split yet; split a \
                          communicator of host ranks, or an in-process group of devices"
                        .into(),
                })
            }
        };
        let (p, r) = (self.world_size(), self.rank());
        // Every rank's color (-1: none) and key.
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * p];
        self.all_gather(&mine, &mut all)?;
        let number = self.splits.fetch_add(1, Ordering::Relaxed);
        let members: Vec<usize> = match color {
            Some(c) => {
                let mut m: Vec<usize> = (0..p).filter(|&k| all[2 * k] == i64::from(c)).collect();
                m.sort_by_key(|&k| (all[2 * k + 1], k));
                m
            }
            None => Vec::new(),
        };
        let config = self.settings();
        // Every member of a group sees the same size: a setting that does not fit it fails
        // the whole group alike (and no other).
        let check = match color {
            Some(_) => config.check(members.len()).map_err(|e| {
                Error::config(format!(
                    "split: the group of color {} ({} ranks) cannot have this \
                     communicator's settings: {e}",
                    color.unwrap_or(0),
                    members.len()
                ))
            }),
            None => Ok(()),
        };
        let new_rank = members.iter().position(|&k| k == r);
        let transport: Arc<dyn Transport> = match regroup {
            Regroup::Threads(group) => {
                check?;
                let (Some(c), Some(at)) = (color, new_rank) else {
                    return Ok(None);
                };
                let (t, engine) = take_local(
                    Pending {
                        group,
                        number,
                        color: c,
                    },
                    &members,
                    at,
                    config.timeout,
                    engine.as_deref(),
                );
                let Some(engine) = engine else {
                    return Ok(Some(Communicator::new(Arc::new(t), &config)));
                };
                let engine = engine.map_err(|e| match e {
                    Error::Unavailable { why, .. } => Error::Unavailable {
                        what: format!("split of {} ranks", self.device_spec()),
                        why,
                    },
                    e => e,
                })?;
                return Ok(Some(Communicator::with_engine(
                    Arc::new(t),
                    &config,
                    Some(engine),
                    self.device,
                )));
            }
            Regroup::Network {
                token,
                listen_host,
                kind,
            } => {
                let store = SplitStore {
                    comm: self,
                    members: &members,
                    record: Mutex::new(None),
                    all: Mutex::new(None),
                };
                // A rank outside every group, or of a group that cannot be made, still takes
                // part in the address all-gather, with an empty record.
                let (Some(at), Ok(())) = (new_rank, &check) else {
                    store.gather()?;
                    check?;
                    return Ok(None);
                };
                let meet = Meeting {
                    rank: at,
                    world: members.len(),
                    token: &token,
                    listen_host: &listen_host,
                    deadline: std::time::Instant::now() + config.timeout,
                    served_by: "the communicator being split",
                };
                let t = NetTransport::meet(&store, &meet, kind, config.timeout, config.chunk_bytes);
                // The all-gather runs inside `meet`, once this rank listens; should `meet`
                // fail before that, the peers still need this rank's part of it.
                if store.all.lock().is_none() {
                    store.gather()?;
                }
                Arc::new(t?)
            }
            #[cfg(feature = "mpi")]
            Regroup::Mpi(parent) => {
                // Every rank of the parent takes part (a rank of no group, or of a group whose
                // settings fail their check, makes no communicator).
                let group = (new_rank.is_some() && check.is_ok()).then_some(&members[..]);
                let t = parent.split(group, config.timeout)?;
                check?;
                match t {
                    Some(t) => Arc::new(t),
                    None => return Ok(None),
                }
            }
        };
        Ok(Some(Communicator::new(transport, &config)))
    }
}

impl Communicator {
    /// This communicator's settings, for one made from it (a split, the survivors of a
    /// shrink): its timeout, algorithm, chunk size, modes and cost-model figures.
    pub(super) fn settings(&self) -> Config {
        let shared = self.progress.shared();
        Config {
            timeout: self.timeout(),
            algorithm: self.algorithm,
            chunk_bytes: shared.chunk_bytes,
            full_check: shared.full_check,
            deterministic: shared.deterministic,
            compression: shared.compression,
            cost_model: crate::tuning::CostModel::Figures(shared.tuning.lock().0),
        }
    }
}

/// Rank `at`'s transport of the threads `members` (ranks of the parent group) of one color, and
/// (when the parent has `engine`) their engine or why it could not be made: the first member
/// to come makes the group's, each takes its own.
fn take_local(
    id: Pending,
    members: &[usize],
    at: usize,
    timeout: std::time::Duration,
    engine: Option<&dyn GroupEngine>,
) -> (LocalTransport, Option<SubEngine>) {
    let mut pending = PENDING.lock();
    let map = pending.get_or_insert_with(HashMap::new);
    // A member whose thread failed the split's all-gather (aborted, timed out) never comes for
    // its part: a group not taken whole within twice the timeout is dropped. The members that
    // took theirs time out on their first call, waiting for the missing one; one that comes
    // later still makes a group of its own, whose first call times out the same way.
    let now = std::time::Instant::now();
    prune(map, now);
    let group = map.entry(id).or_insert_with(|| Taken {
        slots: LocalTransport::group(members.len(), timeout)
            .into_iter()
            .map(Some)
            .collect(),
        engine: engine.map(|e| e.subgroup(members)),
        until: now.checked_add(timeout.saturating_mul(2)),
    });
    let t = group.slots[at]
        .take()
        .expect("each member takes its transport once");
    let engine = group.engine.clone();
    if group.slots.iter().all(Option::is_none) {
        map.remove(&id);
    }
    (t, engine)
}

/// Drop the groups of `map` no member is still coming for at `now`.
fn prune(map: &mut HashMap<Pending, Taken>, now: std::time::Instant) {
    map.retain(|_, g| g.until.is_none_or(|u| u > now));
}

/// The rendezvous of a split between processes, as the store `NetTransport::meet` reads: this
/// rank's address record is set, then read back with every member's, which one all-gather over
/// the parent brings (every rank of the parent takes part, members or not).
struct SplitStore<'a> {
    comm: &'a Communicator,
    /// The group's members, by their rank in the parent, in new-rank order.
    members: &'a [usize],
    record: Mutex<Option<Vec<u8>>>,
    /// Every parent rank's record, once gathered.
    all: Mutex<Option<Vec<u8>>>,
}

impl SplitStore<'_> {
    /// Gather every parent rank's record (this rank's, or an empty one).
    fn gather(&self) -> Result<()> {
        let mut mine = [0u8; RECORD];
        if let Some(r) = self.record.lock().as_ref() {
            mine[..2].copy_from_slice(&(r.len() as u16).to_le_bytes());
            mine[2..2 + r.len()].copy_from_slice(r);
        }
        let mut all = vec![0u8; RECORD * self.comm.world_size()];
        self.comm.all_gather(&mine, &mut all)?;
        *self.all.lock() = Some(all);
        Ok(())
    }
}

impl Store for SplitStore<'_> {
    fn set(&self, _key: &str, value: &[u8]) -> Result<()> {
        if value.len() > RECORD - 2 {
            return Err(Error::config(format!(
                "split: this rank's address record is {} bytes, more than {}",
                value.len(),
                RECORD - 2
            )));
        }
        *self.record.lock() = Some(value.to_vec());
        Ok(())
    }

    fn get(&self, key: &str, _timeout: std::time::Duration) -> Result<Vec<u8>> {
        if self.all.lock().is_none() {
            self.gather()?;
        }
        // Keys are `tutti/{generation}/addr/{new rank}`.
        let at = key
            .rsplit('/')
            .next()
            .and_then(|r| r.parse::<usize>().ok())
            .and_then(|r| self.members.get(r).copied())
            .ok_or_else(|| Error::config(format!("split: no member for key '{key}'")))?;
        let all = self.all.lock();
        let rec = &all.as_ref().expect("gathered above")[at * RECORD..(at + 1) * RECORD];
        let len = usize::from(u16::from_le_bytes([rec[0], rec[1]]));
        if len == 0 || len > RECORD - 2 {
            return Err(Error::config(format!(
                "split: rank {at} published no address for this group (a record of {len} bytes)"
            )));
        }
        Ok(rec[2..2 + len].to_vec())
    }

    fn add(&self, _key: &str, _delta: i64) -> Result<i64> {
        // The split's connections are its own: one generation.
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group whose member never came for its part is held for twice the timeout, then
    /// dropped by the next split of threads.
    #[test]
    fn a_group_a_member_never_takes_is_dropped_after_twice_the_timeout() {
        let timeout = std::time::Duration::from_secs(10);
        let id = Pending {
            group: usize::MAX,
            number: 0,
            color: 3,
        };
        let before = std::time::Instant::now();
        // Member 0 of 2 takes its part; member 1 never comes.
        let (_t, engine) = take_local(id, &[0, 1], 0, timeout, None);
        assert!(engine.is_none());
        let mut map = HashMap::new();
        {
            let mut pending = PENDING.lock();
            let held = pending
                .as_mut()
                .unwrap()
                .remove(&id)
                .expect("the group is held");
            let until = held.until.expect("a deadline");
            assert!(
                until >= before + 2 * timeout && until <= std::time::Instant::now() + 2 * timeout
            );
            map.insert(id, held);
        }
        prune(&mut map, before + timeout);
        assert!(map.contains_key(&id), "dropped within the timeout");
        prune(&mut map, before + 3 * timeout);
        assert!(map.is_empty(), "the group's parts are still held");
        // A timeout too long to count is never dropped.
        let (_t, _) = take_local(id, &[0, 1], 0, std::time::Duration::MAX, None);
        let held = PENDING.lock().as_mut().unwrap().remove(&id).unwrap();
        assert!(held.until.is_none());
    }
}
