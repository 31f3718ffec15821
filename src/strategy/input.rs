//! Input, as tf.distribute has it: a dataset of global batches split across every replica in
//! sync and shared among the workers by an auto-shard policy
//! ([`Strategy::experimental_distribute_dataset`]), a per-worker input function given an
//! [`InputContext`] ([`Strategy::distribute_datasets_from_function`]), per-replica values
//! from a function ([`Strategy::experimental_distribute_values_from_function`]), and the steps'
//! batches made ahead by a thread, on the replicas' devices where asked
//! ([`DistributedDataset::prefetch`], [`DistributedDataset::to_devices`]).

use std::ops::Range;
use std::path::PathBuf;

use super::{PerReplica, Strategy, Tensor};
use crate::algorithm::partition;
use crate::device::DeviceTensor;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// How [`Strategy::experimental_distribute_dataset`] shares a dataset among the workers
/// (TensorFlow's `tf.data.experimental.AutoShardPolicy`). Within a worker each batch is split
/// across the local replicas.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum AutoShardPolicy {
    /// FILE where the dataset is read from at least as many files as there are workers, else
    /// DATA with a warning.
    #[default]
    Auto,
    /// Each worker reads only its files (`files[worker::workers]`), batched to its share of
    /// the global batch. Workers whose files hold different numbers of examples get different
    /// numbers of batches, and a step's collectives then wait for the one that ran out (as in
    /// TensorFlow): give the workers even files.
    File,
    /// Every worker reads every global batch and keeps its replicas' rows.
    Data,
    /// No sharding: every worker reads every element, in batches of its share of the global
    /// batch (each global batch makes as many steps as there are workers), so each replica's
    /// batch is the global batch over the replicas in sync, as under the other policies.
    Off,
}

/// What [`Strategy::distribute_datasets_from_function`] hands the dataset function (TensorFlow's
/// `tf.distribute.InputContext`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct InputContext {
    /// Input pipelines: one per worker.
    pub num_input_pipelines: usize,
    /// This worker's pipeline.
    pub input_pipeline_id: usize,
    /// Replicas in sync across the job.
    pub num_replicas_in_sync: usize,
}

impl InputContext {
    /// The global batch over the replicas in sync; it must divide evenly.
    pub fn get_per_replica_batch_size(&self, global_batch_size: usize) -> Result<usize> {
        if global_batch_size % self.num_replicas_in_sync != 0 {
            return Err(Error::config(format!(
                "the global batch size ({global_batch_size}) is not divisible by the number of \
                 replicas in sync ({})",
                self.num_replicas_in_sync
            )));
        }
        Ok(global_batch_size / self.num_replicas_in_sync)
    }
}

/// What [`Strategy::experimental_distribute_values_from_function`] hands the value function.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ValueContext {
    /// The replica's index among every replica in sync.
    pub replica_id_in_sync_group: usize,
    /// Replicas in sync across the job.
    pub num_replicas_in_sync: usize,
}

/// A batch: rows along the first axis of each of its tensors.
pub trait Batch: Clone + Send + 'static {
    /// The rows (every tensor's first dimension, which must agree).
    fn rows(&self) -> Result<usize>;
    /// Rows `rows` of every tensor (within [`Batch::rows`], which is checked first).
    fn take(&self, rows: Range<usize>) -> Self;
    /// The batches one after the other.
    fn concat(parts: &[Self]) -> Result<Self>;
}

impl<T: Element> Batch for Tensor<T> {
    fn rows(&self) -> Result<usize> {
        let n: Option<usize> = self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if n != Some(self.data.len()) {
            return Err(Error::config(format!(
                "a batch's tensor of shape {:?} holds {} elements",
                self.shape,
                self.data.len()
            )));
        }
        self.shape
            .first()
            .copied()
            .ok_or_else(|| Error::config("a batch's tensors need a first dimension (rows)"))
    }

    fn take(&self, rows: Range<usize>) -> Self {
        let row: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = rows.len();
        Tensor {
            data: self.data[rows.start * row..rows.end * row].to_vec(),
            shape,
        }
    }

    fn concat(parts: &[Self]) -> Result<Self> {
        Tensor::concat(parts, 0)
    }
}

impl<A: Batch, B: Batch> Batch for (A, B) {
    fn rows(&self) -> Result<usize> {
        let (a, b) = (self.0.rows()?, self.1.rows()?);
        if a != b {
            return Err(Error::config(format!(
                "a batch's tensors differ in rows: {a} and {b}"
            )));
        }
        Ok(a)
    }

    fn take(&self, rows: Range<usize>) -> Self {
        (self.0.take(rows.clone()), self.1.take(rows))
    }

    fn concat(parts: &[Self]) -> Result<Self> {
        let (a, b): (Vec<A>, Vec<B>) = parts.iter().cloned().unzip();
        Ok((A::concat(&a)?, B::concat(&b)?))
    }
}

/// A batch whose tensors can be placed on a replica's device
/// ([`DistributedDataset::to_devices`]): each becomes a [`DeviceTensor`] there, its shape kept.
pub trait DeviceBatch: Batch {
    /// The batch on a device.
    type Placed: Send + 'static;
    /// Every tensor placed by `put` (its element type and bytes in, the tensor on the device
    /// out), in the batch's structure.
    fn place(&self, put: &dyn Fn(DType, &[u8]) -> Result<DeviceTensor>) -> Result<Self::Placed>;
}

/// A batch's tensor on a replica's device: the elements, row-major, and the shape.
#[derive(Debug)]
pub struct PlacedTensor {
    /// The elements, on the device.
    pub tensor: DeviceTensor,
    /// The dimensions.
    pub shape: Vec<usize>,
}

impl<T: Element> DeviceBatch for Tensor<T> {
    type Placed = PlacedTensor;
    fn place(&self, put: &dyn Fn(DType, &[u8]) -> Result<DeviceTensor>) -> Result<PlacedTensor> {
        Ok(PlacedTensor {
            tensor: put(T::DTYPE, bytemuck::cast_slice(&self.data))?,
            shape: self.shape.clone(),
        })
    }
}

impl<A: DeviceBatch, B: DeviceBatch> DeviceBatch for (A, B) {
    type Placed = (A::Placed, B::Placed);
    fn place(&self, put: &dyn Fn(DType, &[u8]) -> Result<DeviceTensor>) -> Result<Self::Placed> {
        Ok((self.0.place(put)?, self.1.place(put)?))
    }
}

/// What reads a file's examples.
type Reader<B> = dyn Fn(&std::path::Path) -> Result<B> + Send;

/// A dataset read from files: `read(path)` gives a file's examples as one batch (a row per
/// example), which are cut in order into global batches of `batch_size` rows (the last may be
/// short). Under [`AutoShardPolicy::File`] each worker reads only its files.
pub struct FileDataset<B> {
    files: Vec<PathBuf>,
    read: Box<Reader<B>>,
    batch_size: usize,
}

impl<B: Batch> FileDataset<B> {
    /// A dataset of `files`, read by `read`, in global batches of `batch_size` rows.
    pub fn new(
        files: Vec<PathBuf>,
        batch_size: usize,
        read: impl Fn(&std::path::Path) -> Result<B> + Send + 'static,
    ) -> Result<FileDataset<B>> {
        if batch_size == 0 {
            return Err(Error::config("FileDataset: batch_size must be at least 1"));
        }
        Ok(FileDataset {
            files,
            read: Box::new(read),
            batch_size,
        })
    }

    /// The files.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The files picked by `pick`, read in order and cut into batches of `rows` rows.
    fn batches(self, pick: impl Fn(usize) -> bool + Send + 'static, rows: usize) -> Batches<B> {
        let FileDataset { files, read, .. } = self;
        let mut files = files
            .into_iter()
            .enumerate()
            .filter(move |(i, _)| pick(*i))
            .map(|(_, f)| f);
        // The files' rows not yet handed out: whole chunks, the first from row `at`.
        let mut pending: std::collections::VecDeque<(B, usize)> = Default::default();
        let (mut at, mut have, mut read_all, mut failed) = (0usize, 0usize, false, false);
        Box::new(std::iter::from_fn(move || loop {
            if failed {
                return None;
            }
            if have >= rows || (read_all && have > 0) {
                // The next batch: `rows` rows, or what is left at the end; only the chunks it
                // spans are copied.
                let n = have.min(rows);
                let mut pieces = Vec::new();
                let mut need = n;
                while need > 0 {
                    let Some((chunk, len)) = pending.front() else {
                        break;
                    };
                    let take = (len - at).min(need);
                    pieces.push(chunk.take(at..at + take));
                    (at, need) = (at + take, need - take);
                    if at == *len {
                        pending.pop_front();
                        at = 0;
                    }
                }
                have -= n;
                let batch = match pieces.len() {
                    1 => Ok(pieces.pop().expect("one piece")),
                    _ => B::concat(&pieces),
                };
                failed = batch.is_err();
                return Some(batch);
            }
            if read_all {
                return None;
            }
            let Some(f) = files.next() else {
                read_all = true;
                continue;
            };
            match (read)(&f).and_then(|b| Ok((b.rows()?, b))) {
                Ok((0, _)) => {}
                Ok((n, b)) => {
                    have += n;
                    pending.push_back((b, n));
                }
                Err(e) => {
                    failed = true;
                    return Some(Err(Error::config(format!(
                        "FileDataset: reading {}: {e}",
                        f.display()
                    ))));
                }
            }
        }))
    }
}

/// What a dataset is read from: global batches from any iterator, or files.
pub enum Dataset<B> {
    /// Global batches.
    Batches(Box<dyn Iterator<Item = B> + Send>),
    /// Files, read into global batches.
    Files(FileDataset<B>),
}

impl<B: Batch> Dataset<B> {
    /// Global batches from any iterator.
    pub fn from_batches(batches: impl IntoIterator<Item = B, IntoIter: Send + 'static>) -> Self {
        Dataset::Batches(Box::new(batches.into_iter()))
    }
}

type Batches<B> = Box<dyn Iterator<Item = Result<B>> + Send>;

/// Per-replica batches, as [`Strategy::experimental_distribute_dataset`] and
/// [`Strategy::distribute_datasets_from_function`] give them: iterate for one
/// [`PerReplica`] per step (a replica may get no rows of a short last batch), to hand to
/// [`Strategy::run`].
///
/// A dataset describes the workers as they were when it was made: after
/// [`Strategy::shrink`] make it again.
pub struct DistributedDataset<B> {
    batches: Batches<B>,
    /// Each batch is cut into `parts`, this worker's replicas taking `first..first + local`;
    /// `None`: each local replica takes a whole batch of its own.
    cut: Option<(usize, usize)>,
    local: usize,
    done: bool,
}

impl<B: Batch> Iterator for DistributedDataset<B> {
    type Item = Result<PerReplica<B>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let step = (|| -> Result<Option<PerReplica<B>>> {
            match self.cut {
                Some((parts, first)) => {
                    let Some(batch) = self.batches.next().transpose()? else {
                        return Ok(None);
                    };
                    let n = batch.rows()?;
                    Ok(Some(PerReplica(
                        (first..first + self.local)
                            .map(|g| batch.take(partition(n, parts, g)))
                            .collect(),
                    )))
                }
                None => {
                    let mut got = Vec::with_capacity(self.local);
                    for b in self.batches.by_ref().take(self.local) {
                        got.push(b?);
                    }
                    let Some(last) = got.last() else {
                        return Ok(None);
                    };
                    last.rows()?;
                    // A short final group: the missing replicas get no rows.
                    let empty = last.take(0..0);
                    if got.len() < self.local {
                        self.done = true;
                        got.resize_with(self.local, || empty.take(0..0));
                    }
                    Ok(Some(PerReplica(got)))
                }
            }
        })();
        match step {
            Ok(Some(p)) => Some(Ok(p)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

impl<B: Batch> DistributedDataset<B> {
    /// The same per-replica batches, made up to `buffer_size` steps ahead by a thread of their
    /// own, as tf.data's `prefetch`: reading files and cutting batches overlap the steps. An
    /// error reaches the caller in its place, after the batches before it.
    pub fn prefetch(self, buffer_size: usize) -> Result<Prefetched<PerReplica<B>>> {
        Prefetched::spawn(self, buffer_size)
    }

    /// The same per-replica batches, each replica's placed on that replica's device up to
    /// `buffer_size` steps ahead, by a thread of their own (TensorFlow's
    /// `experimental_fetch_to_device` and `experimental_per_replica_buffer_size`): PJRT buffers on
    /// the replicas' XLA devices under [`Strategy::tpu`], where the replica context's
    /// collectives on tensors take them; host memory for CPU replicas. `strategy` is the one
    /// the dataset was made by. A batch's upload then overlaps the step before it.
    pub fn to_devices(
        self,
        strategy: &Strategy,
        buffer_size: usize,
    ) -> Result<Prefetched<PerReplica<B::Placed>>>
    where
        B: DeviceBatch,
    {
        let placer = strategy.placer();
        if self.local != placer.local() {
            return Err(Error::config(format!(
                "to_devices: the dataset is cut for {} local replicas, the strategy has {}: \
                 pass the strategy that made it",
                self.local,
                placer.local()
            )));
        }
        let placed = self.map(move |step| {
            let step = step?;
            let mut out = Vec::with_capacity(step.0.len());
            for (i, batch) in step.0.iter().enumerate() {
                out.push(batch.place(&|dtype, bytes| placer.place(i, dtype, bytes))?);
            }
            Ok(PerReplica(out))
        });
        Prefetched::spawn(placed, buffer_size)
    }
}

/// Values made ahead by a thread of their own, at most `buffer_size` of them
/// ([`DistributedDataset::prefetch`], [`DistributedDataset::to_devices`]). Each error reaches
/// the caller in its place and ends the values; a panic of the dataset's own iterator is
/// resumed in the caller's `next`. Dropped early, the thread stops once it has made the value
/// in hand.
pub struct Prefetched<T> {
    rx: crossbeam_channel::Receiver<Result<T>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<T: Send + 'static> Prefetched<T> {
    fn spawn(
        source: impl Iterator<Item = Result<T>> + Send + 'static,
        buffer_size: usize,
    ) -> Result<Prefetched<T>> {
        if buffer_size == 0 {
            return Err(Error::config(
                "prefetching: the buffer size must be at least 1 (steps made ahead)",
            ));
        }
        // The thread holds the value it made while it waits to hand it over: the channel
        // holds the rest.
        let (tx, rx) = crossbeam_channel::bounded(buffer_size - 1);
        let thread = std::thread::Builder::new()
            .name("tutti-input".into())
            .spawn(move || {
                for item in source {
                    let failed = item.is_err();
                    if tx.send(item).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| Error::io("starting the input thread", e))?;
        Ok(Prefetched {
            rx,
            thread: Some(thread),
        })
    }
}

impl<T> Iterator for Prefetched<T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        if let Ok(item) = self.rx.recv() {
            return Some(item);
        }
        // The thread ended: the values are done, or the dataset's iterator panicked.
        if let Some(Err(panic)) = self.thread.take().map(std::thread::JoinHandle::join) {
            std::panic::resume_unwind(panic);
        }
        None
    }
}

impl Strategy {
    /// `dataset`'s global batches split across every replica in sync (the first `rows %
    /// replicas` replicas get a row more), the workers sharing it by `policy`; each element is
    /// one step's [`PerReplica`] batches.
    pub fn experimental_distribute_dataset<B: Batch>(
        &self,
        dataset: Dataset<B>,
        policy: AutoShardPolicy,
    ) -> Result<DistributedDataset<B>> {
        let (worker, workers) = (self.worker_index(), self.resolver.num_workers);
        let local = self.num_local_replicas();
        let policy = match (policy, &dataset) {
            (AutoShardPolicy::Auto, Dataset::Files(f)) if f.files.len() >= workers => {
                AutoShardPolicy::File
            }
            (AutoShardPolicy::Auto, _) => {
                if workers > 1 {
                    log::warn!(
                        "experimental_distribute_dataset: AUTO sharding found no files to shard (a \
                         FileDataset with at least {workers} files): sharding by DATA, every \
                         worker reads every element and keeps its share"
                    );
                }
                AutoShardPolicy::Data
            }
            (p, _) => p,
        };
        let all = |d: Dataset<B>| -> Batches<B> {
            match d {
                Dataset::Batches(b) => Box::new(b.map(Ok)),
                Dataset::Files(f) => {
                    let rows = f.batch_size;
                    f.batches(|_| true, rows)
                }
            }
        };
        let (batches, cut) = match policy {
            AutoShardPolicy::File => {
                let Dataset::Files(f) = dataset else {
                    return Err(Error::config(
                        "experimental_distribute_dataset: FILE sharding needs a Dataset::Files",
                    ));
                };
                if f.files.len() < workers {
                    return Err(Error::config(format!(
                        "experimental_distribute_dataset: FILE sharding of {} files over \
                         {workers} workers leaves a worker none; use DATA or more files",
                        f.files.len()
                    )));
                }
                if f.batch_size < workers {
                    return Err(Error::config(format!(
                        "experimental_distribute_dataset: a global batch of {} rows cannot be \
                         shared by FILE among {workers} workers",
                        f.batch_size
                    )));
                }
                if f.files.len() % workers != 0 {
                    log::warn!(
                        "experimental_distribute_dataset: {} files sharded by FILE over \
                         {workers} workers, some reading one more: workers whose files hold \
                         more examples run more steps, and a step then waits for the others",
                        f.files.len()
                    );
                }
                let rows = partition(f.batch_size, workers, worker).len();
                let batches = f.batches(move |i| i % workers == worker, rows);
                (batches, (local, 0))
            }
            AutoShardPolicy::Data => (all(dataset), (local * workers, worker * local)),
            _ => {
                // Off: each global batch cut into one piece per worker, each a step here.
                let pieces = all(dataset).flat_map(move |b| -> Vec<Result<B>> {
                    match b.and_then(|b| Ok((b.rows()?, b))) {
                        Err(e) => vec![Err(e)],
                        Ok((n, b)) => (0..workers)
                            .map(|k| Ok(b.take(partition(n, workers, k))))
                            .collect(),
                    }
                });
                (Box::new(pieces) as Batches<B>, (local, 0))
            }
        };
        Ok(DistributedDataset {
            batches,
            cut: Some(cut),
            local,
            done: false,
        })
    }

    /// `dataset_fn(&InputContext)` once on this worker (its input pipeline): batches of one
    /// replica each, handed to the local replicas in turn, one [`PerReplica`] per step. Shard
    /// inside `dataset_fn` by `input_pipeline_id`; size the batches with
    /// [`InputContext::get_per_replica_batch_size`].
    pub fn distribute_datasets_from_function<B: Batch, I>(
        &self,
        dataset_fn: impl FnOnce(&InputContext) -> I,
    ) -> DistributedDataset<B>
    where
        I: IntoIterator<Item = B>,
        I::IntoIter: Send + 'static,
    {
        let ctx = InputContext {
            num_input_pipelines: self.resolver.num_workers,
            input_pipeline_id: self.worker_index(),
            num_replicas_in_sync: self.num_replicas_in_sync(),
        };
        DistributedDataset {
            batches: Box::new(dataset_fn(&ctx).into_iter().map(Ok)),
            cut: None,
            local: self.num_local_replicas(),
            done: false,
        }
    }

    /// `value_fn(&ValueContext)` for each local replica.
    pub fn experimental_distribute_values_from_function<T>(
        &self,
        value_fn: impl Fn(&ValueContext) -> T,
    ) -> PerReplica<T> {
        let first = self.worker_index() * self.num_local_replicas();
        PerReplica(
            (first..first + self.num_local_replicas())
                .map(|g| {
                    value_fn(&ValueContext {
                        replica_id_in_sync_group: g,
                        num_replicas_in_sync: self.num_replicas_in_sync(),
                    })
                })
                .collect(),
        )
    }
}
