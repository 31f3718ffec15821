//! The one-call form: collectives over a set of per-replica buffers held by one caller, as
//! TensorFlow's cross-device ops take them.
//!
//! A [`Replicas`] owns an in-process group and a worker thread per replica but the first (the
//! caller runs that one), built once and reused by every call: the same algorithms as the
//! per-rank API, with no thread started per call.

use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};

use super::{local_group, Communicator, Config};
use crate::dtype::{Element, ReduceOp};
use crate::error::{Error, Result};

type Task<'a> = dyn Fn(usize, &Communicator) -> Result<()> + Sync + 'a;

/// A task borrowed for the duration of one [`Replicas::each`] call.
struct Job(&'static Task<'static>);

struct Worker {
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<()>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

/// A group of replicas driven from one thread. See the module docs.
pub struct Replicas {
    first: Communicator,
    workers: Vec<Worker>,
    timeout: Duration,
    /// One `each` at a time: the workers' job and answer channels are shared.
    running: parking_lot::Mutex<()>,
}

/// A buffer pointer handed to the replica that owns it.
struct Ptr<T>(*mut T, usize);
// SAFETY: each `Ptr` is dereferenced by exactly one replica while the call that made it waits.
unsafe impl<T> Send for Ptr<T> {}
unsafe impl<T> Sync for Ptr<T> {}

impl<T> Ptr<T> {
    /// SAFETY: the caller is the one replica that uses this buffer, while the call that made
    /// the pointer waits.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0, self.1)
    }
}

impl Replicas {
    /// `n` replicas with `config`.
    pub fn new(n: usize, config: &Config) -> Result<Replicas> {
        Replicas::from_group(local_group(n, config)?, config)
    }

    /// Replicas over any in-process group (e.g. [`super::device_group`]'s): replica r is rank
    /// r. `config`'s timeout bounds each call's wait for the replica threads.
    pub fn from_group(comms: Vec<Communicator>, config: &Config) -> Result<Replicas> {
        if comms.is_empty() {
            return Err(Error::config("replicas: the group has no rank"));
        }
        let mut comms = comms.into_iter();
        let first = comms.next().expect("a group has a rank 0");
        let mut workers = Vec::with_capacity(comms.len());
        for comm in comms {
            let (jobs, rx) = bounded::<Job>(1);
            let (tx, done) = bounded::<Result<()>>(1);
            let rank = comm.rank();
            let handle = std::thread::Builder::new()
                .name(format!("tutti-replica-{rank}"))
                .spawn(move || {
                    for Job(task) in rx {
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            task(rank, &comm)
                        }))
                        .unwrap_or_else(|_| {
                            let e = format!("replica {rank} panicked");
                            comm.abort(&e);
                            Err(Error::Aborted { rank, reason: e })
                        });
                        if tx.send(r).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| Error::io("starting a replica thread", e))?;
            workers.push(Worker {
                jobs: Some(jobs),
                done,
                handle: Some(handle),
            });
        }
        Ok(Replicas {
            first,
            workers,
            timeout: config.timeout,
            running: parking_lot::Mutex::new(()),
        })
    }

    /// Number of replicas.
    pub fn num_replicas(&self) -> usize {
        self.workers.len() + 1
    }

    /// Run `task(replica, communicator)` on every replica at once; the first error in replica
    /// order wins, preferring a root cause over the `Aborted` it caused elsewhere.
    pub fn each(&self, task: &Task<'_>) -> Result<()> {
        let _one_at_a_time = self.running.lock();
        // SAFETY: every worker reports back before this function returns (below), so the task
        // outlives every use of it.
        let job: &'static Task<'static> =
            unsafe { std::mem::transmute::<&Task<'_>, &'static Task<'static>>(task) };
        let mut sent = 0;
        for w in &self.workers {
            match w.jobs.as_ref().map(|j| j.send(Job(job))) {
                Some(Ok(())) => sent += 1,
                _ => break,
            }
        }
        // Replica 0 runs here. A panic in it must not unwind past the workers still using
        // `task`: it is caught, the group aborted, the workers awaited, then the panic resumed.
        let mut panic = None;
        let mut results = vec![if sent == self.workers.len() {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(0, &self.first))) {
                Ok(r) => r,
                Err(p) => {
                    self.first.abort("replica 0 panicked");
                    panic = Some(p);
                    Err(Error::Aborted {
                        rank: 0,
                        reason: "replica 0 panicked".into(),
                    })
                }
            }
        } else {
            let e = "a replica thread has stopped; build a new Replicas".to_string();
            self.first.abort(&e);
            Err(Error::Aborted { rank: 0, reason: e })
        }];
        for w in &self.workers[..sent] {
            let r = match w
                .done
                .recv_timeout(self.timeout * 2 + Duration::from_secs(5))
            {
                Ok(r) => r,
                Err(_) => {
                    // Every wait inside a task watches the abort flag: after this the worker
                    // returns promptly, and we must not return before it does.
                    self.first
                        .abort("a replica did not finish within twice the timeout");
                    w.done.recv().unwrap_or_else(|_| {
                        Err(Error::Aborted {
                            rank: 0,
                            reason: "replica lost".into(),
                        })
                    })
                }
            };
            results.push(r);
        }
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        let mut errors = results.into_iter().filter_map(|r| r.err());
        let first = errors.next();
        match first {
            Some(Error::Aborted { .. }) => Err(errors
                .find(|e| !matches!(e, Error::Aborted { .. }))
                .unwrap_or(first.unwrap())),
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Abort the group: every blocked and later collective of every replica fails at once.
    /// Build a new `Replicas` afterwards.
    pub fn abort(&self, reason: &str) {
        self.first.abort(reason)
    }

    /// The abort reason, once aborted.
    pub fn aborted(&self) -> Option<String> {
        self.first.aborted()
    }

    /// A handle that aborts the group from any thread.
    pub fn abort_handle(&self) -> super::AbortHandle {
        self.first.abort_handle()
    }

    fn check_len(&self, what: &str, n: usize) -> Result<()> {
        if n != self.num_replicas() {
            return Err(Error::config(format!(
                "{what}: {n} buffers given for {} replicas; pass one per replica",
                self.num_replicas()
            )));
        }
        Ok(())
    }

    /// All-reduce in place across the replicas' buffers.
    pub fn all_reduce<T: Element>(&self, bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
        self.check_len("all_reduce", bufs.len())?;
        let ptrs: Vec<Ptr<T>> = bufs
            .iter_mut()
            .map(|b| Ptr(b.as_mut_ptr(), b.len()))
            .collect();
        self.each(&|r, comm| {
            // SAFETY: replica r alone uses buffer r, while `each` waits.
            let b = unsafe { ptrs[r].slice() };
            comm.all_reduce(b, op)
        })
    }

    /// Broadcast replica `root`'s buffer into every other replica's.
    pub fn broadcast<T: Element>(&self, bufs: &mut [&mut [T]], root: usize) -> Result<()> {
        self.check_len("broadcast", bufs.len())?;
        let ptrs: Vec<Ptr<T>> = bufs
            .iter_mut()
            .map(|b| Ptr(b.as_mut_ptr(), b.len()))
            .collect();
        self.each(&|r, comm| {
            // SAFETY: as in all_reduce.
            let b = unsafe { ptrs[r].slice() };
            comm.broadcast(b, root)
        })
    }

    /// All-gather: every `outputs[r]` becomes the concatenation of `inputs` in replica order.
    pub fn all_gather<T: Element>(&self, inputs: &[&[T]], outputs: &mut [&mut [T]]) -> Result<()> {
        self.check_len("all_gather inputs", inputs.len())?;
        self.check_len("all_gather outputs", outputs.len())?;
        let outs: Vec<Ptr<T>> = outputs
            .iter_mut()
            .map(|b| Ptr(b.as_mut_ptr(), b.len()))
            .collect();
        self.each(&|r, comm| {
            // SAFETY: as in all_reduce.
            let o = unsafe { outs[r].slice() };
            comm.all_gather(inputs[r], o)
        })
    }

    /// Reduce every replica's input into `output` (TensorFlow's reduce to one destination).
    pub fn reduce<T: Element>(
        &self,
        inputs: &[&[T]],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_len("reduce", inputs.len())?;
        let out = Ptr(output.as_mut_ptr(), output.len());
        self.each(&|r, comm| {
            // SAFETY: replica 0 alone writes the output, while `each` waits.
            let o = (r == 0).then(|| unsafe { out.slice() });
            comm.reduce(inputs[r], o, op, 0)
        })
    }
}

impl Drop for Replicas {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.jobs.take();
        }
        for w in &mut self.workers {
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
    }
}
