//! Checkpoints: a strategy's variables (and the step) saved to a file and restored from it, in
//! one documented, versioned format that holds every kind of variable by its full value.
//!
//! A [`Checkpoint`] is a step and named tensors of any element type. A mirrored variable is
//! saved as its value (its copies are identical); a central one as its one copy; a variable
//! sharded over parameter servers as the concatenation of its shards
//! ([`Coordinator::read_variable`](super::ps::Coordinator::read_variable)), so it restores onto
//! any number of parameter servers ([`Coordinator::create_variable`](super::ps::Coordinator::create_variable)
//! with the saved value partitions it again).
//!
//! A [`CheckpointManager`] keeps a directory of them, `ckpt-<step>.tutti`, the last
//! `max_to_keep`; the latest is the highest step. [`Strategy::save_checkpoint`](super::Strategy::save_checkpoint)
//! has the chief write (the other workers learn whether it did) and
//! [`Strategy::restore_checkpoint`](super::Strategy::restore_checkpoint) has the chief read and
//! every worker receive it, so the workers need no shared file system.
//!
//! # The file format (version 1)
//!
//! | bytes | what |
//! |---|---|
//! | 8 | the magic `TUTTICKP` |
//! | 4 | the format version, u32 little-endian (1) |
//! | 4 | the header's length H, u32 little-endian |
//! | 32 | SHA-256 of the header and the data that follow |
//! | H | the header, JSON: `{"step": N, "variables": [{"name", "dtype", "shape", "offset", "bytes"}]}` |
//! | rest | the data: each variable's elements, row-major, little-endian, at its `offset` from here |
//!
//! `dtype` is tutti's name (`f32`, `bf16`, `i64`, ...); `bytes` is the product of `shape` times
//! the element's size. A reader refuses a file whose magic, version, checksum, or any
//! variable's extent does not hold, naming what is wrong; nothing is sized by the file's claims
//! beyond the bytes it has. A file is written to a temporary name, synced, then renamed, so a
//! crash mid-save leaves the previous checkpoints as they were.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::Tensor;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// The first bytes of every checkpoint file.
pub const MAGIC: &[u8; 8] = b"TUTTICKP";
/// The format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Magic, version, header length, checksum.
const PREAMBLE: usize = 8 + 4 + 4 + 32;

/// One variable in the header.
#[derive(Serialize, Deserialize)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    offset: usize,
    bytes: usize,
}

#[derive(Serialize, Deserialize)]
struct Header {
    step: u64,
    variables: Vec<Entry>,
}

/// A variable's saved value.
struct Saved {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// A step and named tensors: what a training job needs to go on where it stopped. See the
/// module docs for the file format.
pub struct Checkpoint {
    step: u64,
    variables: Vec<Saved>,
}

fn bad(what: &str, why: impl std::fmt::Display) -> Error {
    Error::config(format!("checkpoint {what}: {why}"))
}

impl Checkpoint {
    /// An empty checkpoint of `step` (the steps trained so far).
    pub fn new(step: u64) -> Checkpoint {
        Checkpoint {
            step,
            variables: Vec::new(),
        }
    }

    /// The step it was saved at.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The variables' names, in the order they were added.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.variables.iter().map(|v| v.name.as_str())
    }

    /// Add `value` as `name`; a name already present is an error (so is an empty name).
    pub fn insert<T: Element>(&mut self, name: &str, value: &Tensor<T>) -> Result<()> {
        let n: usize = value.shape.iter().product();
        if n != value.data.len() {
            return Err(bad(
                name,
                format!(
                    "shape {:?} holds {n} elements, the data {}",
                    value.shape,
                    value.data.len()
                ),
            ));
        }
        self.insert_bytes(
            name,
            T::DTYPE,
            &value.shape,
            bytemuck::cast_slice(&value.data),
        )
    }

    /// Add `name`: elements of `dtype` in `shape`, as their little-endian bytes (what a
    /// caller that knows the element type at run time has, as the C ABI's).
    pub fn insert_bytes(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<()> {
        if name.is_empty() {
            return Err(bad("variable", "a variable needs a name"));
        }
        if self.variables.iter().any(|v| v.name == name) {
            return Err(bad(
                name,
                "a variable of this name is in the checkpoint already",
            ));
        }
        let want = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d));
        if want != Some(bytes.len()) {
            return Err(bad(
                name,
                format!(
                    "shape {shape:?} of {dtype} does not take {} bytes",
                    bytes.len()
                ),
            ));
        }
        self.variables.push(Saved {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data: bytes.to_vec(),
        });
        Ok(())
    }

    /// The variable `name` as saved; an error names a missing variable (and those present) or
    /// an element type other than the one saved.
    pub fn get<T: Element>(&self, name: &str) -> Result<Tensor<T>> {
        let (dtype, shape, bytes) = self.bytes(name)?;
        if dtype != T::DTYPE {
            return Err(bad(name, format!("saved as {dtype}, read as {}", T::DTYPE)));
        }
        let mut data = vec![<T as bytemuck::Zeroable>::zeroed(); bytes.len() / dtype.size()];
        bytemuck::cast_slice_mut::<T, u8>(&mut data).copy_from_slice(bytes);
        Tensor::new(data, shape.to_vec())
    }

    /// The variable `name`: its element type, shape and little-endian bytes; an error names a
    /// missing variable and those present.
    pub fn bytes(&self, name: &str) -> Result<(DType, &[usize], &[u8])> {
        let v = self
            .variables
            .iter()
            .find(|v| v.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.names().collect();
                bad(
                    name,
                    format!("no such variable at step {} (it has {names:?})", self.step),
                )
            })?;
        Ok((v.dtype, &v.shape, &v.data))
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut offset = 0;
        let variables = self
            .variables
            .iter()
            .map(|v| {
                let e = Entry {
                    name: v.name.clone(),
                    dtype: v.dtype.name().into(),
                    shape: v.shape.clone(),
                    offset,
                    bytes: v.data.len(),
                };
                offset += v.data.len();
                e
            })
            .collect();
        let header = serde_json::to_vec(&Header {
            step: self.step,
            variables,
        })
        .map_err(|e| bad("header", e))?;
        let header_len = u32::try_from(header.len())
            .map_err(|_| bad("header", format!("{} bytes; at most 4 GiB", header.len())))?;
        let mut out = Vec::with_capacity(PREAMBLE + header.len() + offset);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&header_len.to_le_bytes());
        out.extend_from_slice(&[0; 32]);
        out.extend_from_slice(&header);
        for v in &self.variables {
            out.extend_from_slice(&v.data);
        }
        let sum = Sha256::digest(&out[PREAMBLE..]);
        out[16..PREAMBLE].copy_from_slice(&sum);
        Ok(out)
    }

    /// A checkpoint from a file's bytes (`what` names the file in errors), every claim checked
    /// against the bytes there are.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Checkpoint> {
        if !bytes.starts_with(MAGIC) {
            return Err(bad(what, "not a tutti checkpoint (no TUTTICKP magic)"));
        }
        if bytes.len() < PREAMBLE {
            return Err(bad(
                what,
                format!(
                    "cut short: {} bytes, fewer than the format's first {PREAMBLE}",
                    bytes.len()
                ),
            ));
        }
        let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let version = word(8);
        if version != FORMAT_VERSION {
            return Err(bad(
                what,
                format!("format version {version}; this build reads version {FORMAT_VERSION}"),
            ));
        }
        if Sha256::digest(&bytes[PREAMBLE..])[..] != bytes[16..PREAMBLE] {
            return Err(bad(
                what,
                "its checksum does not match: the file is damaged or cut short",
            ));
        }
        let header_len = word(12) as usize;
        let Some(data) = bytes[PREAMBLE..].get(header_len..) else {
            return Err(bad(
                what,
                format!(
                    "a header of {header_len} bytes in a file of {}",
                    bytes.len()
                ),
            ));
        };
        let header: Header = serde_json::from_slice(&bytes[PREAMBLE..PREAMBLE + header_len])
            .map_err(|e| bad(what, format!("its header: {e}")))?;
        let mut variables: Vec<Saved> = Vec::with_capacity(header.variables.len().min(data.len()));
        let mut names = std::collections::HashSet::new();
        for e in header.variables {
            let dtype: DType = e
                .dtype
                .parse()
                .map_err(|m| bad(what, format!("variable {:?}: {m}", e.name)))?;
            let want = e
                .shape
                .iter()
                .try_fold(dtype.size(), |a, &d| a.checked_mul(d));
            let extent = e
                .offset
                .checked_add(e.bytes)
                .filter(|&end| end <= data.len());
            if want != Some(e.bytes) || extent.is_none() {
                return Err(bad(
                    what,
                    format!(
                        "variable {:?}: shape {:?} of {dtype} at {} + {} bytes does not fit the {} bytes of data",
                        e.name,
                        e.shape,
                        e.offset,
                        e.bytes,
                        data.len()
                    ),
                ));
            }
            if e.name.is_empty() || !names.insert(e.name.clone()) {
                return Err(bad(
                    what,
                    format!("variable name {:?} empty or repeated", e.name),
                ));
            }
            variables.push(Saved {
                data: data[e.offset..e.offset + e.bytes].to_vec(),
                name: e.name,
                dtype,
                shape: e.shape,
            });
        }
        Ok(Checkpoint {
            step: header.step,
            variables,
        })
    }

    /// Write to `path`: a temporary file beside it (a name no other writer uses), synced,
    /// renamed over it, and the directory synced.
    pub fn write(&self, path: &Path) -> Result<()> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let shown = path.display().to_string();
        let bytes = self.to_bytes()?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = path.with_extension(format!(
            "tutti.tmp-{}-{}-{nanos}",
            std::process::id(),
            WRITES.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => std::fs::File::open(d)?.sync_all(),
                _ => Ok(()),
            }
        })();
        written.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(format!("writing checkpoint {shown}"), e)
        })
    }

    /// Read the checkpoint at `path`.
    pub fn read(path: &Path) -> Result<Checkpoint> {
        let shown = path.display().to_string();
        let bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("reading checkpoint {shown}"), e))?;
        Checkpoint::from_bytes(&bytes, &shown)
    }
}

/// The name of the checkpoint of `step`.
fn file_name(step: u64) -> String {
    format!("ckpt-{step}.tutti")
}

/// A directory of checkpoints, `ckpt-<step>.tutti`, of which the last `max_to_keep` (by step)
/// are kept (TensorFlow's `tf.train.CheckpointManager`); with a checkpoint interval
/// ([`CheckpointManager::with_checkpoint_interval`]), [`CheckpointManager::save_if_due`] saves
/// at most once every that many steps.
pub struct CheckpointManager {
    dir: PathBuf,
    max_to_keep: usize,
    /// Steps between saves by `save_if_due` (TensorFlow's `checkpoint_interval`).
    interval: Option<u64>,
    /// The step this manager last saved (or was told a save of), for the interval.
    last_saved: parking_lot::Mutex<Option<u64>>,
}

impl CheckpointManager {
    /// Keep checkpoints in `dir`, the last `max_to_keep` of them (at least 1). Touches no
    /// file: the directory is made by the first save (so a worker that never writes, as under
    /// a multi-worker strategy, makes none).
    pub fn new(dir: impl Into<PathBuf>, max_to_keep: usize) -> Result<CheckpointManager> {
        if max_to_keep == 0 {
            return Err(Error::config(
                "CheckpointManager: max_to_keep is 0; keep at least the latest checkpoint",
            ));
        }
        Ok(CheckpointManager {
            dir: dir.into(),
            max_to_keep,
            interval: None,
            last_saved: parking_lot::Mutex::new(None),
        })
    }

    /// This manager with TensorFlow's `checkpoint_interval`: [`CheckpointManager::save_if_due`]
    /// (and [`crate::strategy::Strategy::save_checkpoint_if_due`]) save a checkpoint only where
    /// its step is at least `steps` past the last one saved. Call them every step.
    pub fn with_checkpoint_interval(mut self, steps: u64) -> Result<CheckpointManager> {
        if steps == 0 {
            return Err(Error::config(
                "CheckpointManager: a checkpoint interval of 0 steps; at least 1",
            ));
        }
        self.interval = Some(steps);
        Ok(self)
    }

    /// The checkpoint interval, if one was set.
    pub fn checkpoint_interval(&self) -> Option<u64> {
        self.interval
    }

    /// Whether a checkpoint of `step` is due: always without an interval; with one, where this
    /// manager has saved none yet or `step` is at least the interval past the last it saved.
    pub fn due(&self, step: u64) -> bool {
        match (self.interval, *self.last_saved.lock()) {
            (Some(every), Some(last)) => step >= last.saturating_add(every),
            _ => true,
        }
    }

    /// Count a save of `step` for the interval (on every worker, once the chief saved it).
    pub(crate) fn saved(&self, step: u64) {
        *self.last_saved.lock() = Some(step);
    }

    /// [`CheckpointManager::save`] where [`CheckpointManager::due`] says so; `None` otherwise.
    pub fn save_if_due(&self, ckpt: &Checkpoint) -> Result<Option<PathBuf>> {
        if !self.due(ckpt.step) {
            return Ok(None);
        }
        self.save(ckpt).map(Some)
    }

    /// The directory.
    pub fn directory(&self) -> &Path {
        &self.dir
    }

    /// The checkpoints there, by step, oldest first (none where the directory is missing).
    /// Only the names this manager writes count: `ckpt-`, the step in decimal digits as
    /// written (no sign, no leading zeros), `.tutti`.
    pub fn checkpoints(&self) -> Result<Vec<(u64, PathBuf)>> {
        let list = match std::fs::read_dir(&self.dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            r => r.map_err(|e| {
                Error::io(
                    format!("listing checkpoint directory {}", self.dir.display()),
                    e,
                )
            })?,
        };
        let mut found: Vec<(u64, PathBuf)> = list
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                let step: u64 = name
                    .strip_prefix("ckpt-")?
                    .strip_suffix(".tutti")?
                    .parse()
                    .ok()?;
                (name == file_name(step)).then(|| (step, e.path()))
            })
            .collect();
        found.sort();
        Ok(found)
    }

    /// The latest checkpoint's path, if there is one.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        Ok(self.checkpoints()?.pop().map(|(_, p)| p))
    }

    /// Write `ckpt` as `ckpt-<step>.tutti` (replacing one of the same step; the directory is
    /// made if missing), then remove the oldest beyond `max_to_keep`. Returns its path. A step
    /// below the latest one there is an error: the directory holds a later run's checkpoints,
    /// which keeping the last by step would keep over this one (resume from them, or save
    /// elsewhere).
    pub fn save(&self, ckpt: &Checkpoint) -> Result<PathBuf> {
        if let Some((latest, p)) = self.checkpoints()?.pop() {
            if latest > ckpt.step {
                return Err(Error::config(format!(
                    "checkpoint of step {}: {} holds a later one, {}; resume from it or save \
                     in another directory",
                    ckpt.step,
                    self.dir.display(),
                    p.display()
                )));
            }
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| {
            Error::io(
                format!("creating checkpoint directory {}", self.dir.display()),
                e,
            )
        })?;
        let path = self.dir.join(file_name(ckpt.step));
        ckpt.write(&path)?;
        let all = self.checkpoints()?;
        for (_, old) in &all[..all.len().saturating_sub(self.max_to_keep)] {
            std::fs::remove_file(old)
                .map_err(|e| Error::io(format!("removing old checkpoint {}", old.display()), e))?;
        }
        self.saved(ckpt.step);
        Ok(path)
    }

    /// The latest checkpoint read back, or `None` where the directory has none.
    pub fn restore_latest(&self) -> Result<Option<Checkpoint>> {
        self.latest()?.map(|p| Checkpoint::read(&p)).transpose()
    }
}

/// TensorFlow's `SidecarEvaluator`: the `evaluator` task of a TF_CONFIG job, beside the
/// training, evaluates the checkpoints the chief saves into a directory as they appear.
pub struct SidecarEvaluator {
    manager: CheckpointManager,
    max_evaluations: Option<usize>,
    last_step: Option<u64>,
    timeout: std::time::Duration,
    poll: std::time::Duration,
}

impl SidecarEvaluator {
    /// Evaluate the checkpoints of `dir` (a [`CheckpointManager`]'s), waiting for new ones up
    /// to the communicator default timeout, polling every 100 ms.
    pub fn new(dir: impl Into<PathBuf>) -> SidecarEvaluator {
        SidecarEvaluator {
            manager: CheckpointManager {
                dir: dir.into(),
                max_to_keep: usize::MAX,
                interval: None,
                last_saved: parking_lot::Mutex::new(None),
            },
            max_evaluations: None,
            last_step: None,
            timeout: crate::sync::default_timeout(),
            poll: std::time::Duration::from_millis(100),
        }
    }

    /// End after `n` evaluations.
    pub fn max_evaluations(mut self, n: usize) -> SidecarEvaluator {
        self.max_evaluations = Some(n);
        self
    }

    /// End once a checkpoint of `step` or later has been evaluated (the training's last).
    pub fn last_step(mut self, step: u64) -> SidecarEvaluator {
        self.last_step = Some(step);
        self
    }

    /// Wait at most `timeout` for a new checkpoint.
    pub fn timeout(mut self, timeout: std::time::Duration) -> SidecarEvaluator {
        self.timeout = timeout;
        self
    }

    /// Look for a new checkpoint every `interval`.
    pub fn poll_interval(mut self, interval: std::time::Duration) -> SidecarEvaluator {
        self.poll = interval;
        self
    }

    /// Call `evaluate` with each new checkpoint: the latest in the directory whenever it is
    /// newer (by step) than the last evaluated; those saved and superseded between two looks
    /// are skipped, as in TensorFlow. Returns the number evaluated once `max_evaluations` are
    /// done or a checkpoint of `last_step` or later was evaluated. No new checkpoint within
    /// the timeout ends the loop: without either bound that is its end (`Ok`), with one it is
    /// an error naming the directory and the last step evaluated. `evaluate`'s error ends it.
    pub fn run(&self, mut evaluate: impl FnMut(&Checkpoint) -> Result<()>) -> Result<usize> {
        let (mut last, mut count) = (None::<u64>, 0usize);
        let mut since = std::time::Instant::now();
        loop {
            let done_evaluating = self.max_evaluations.is_some_and(|m| count >= m);
            let reached = matches!((self.last_step, last), (Some(l), Some(s)) if s >= l);
            if done_evaluating || reached {
                return Ok(count);
            }
            if let Some((step, path)) = self.manager.checkpoints()?.pop() {
                if last.is_none_or(|l| step > l) {
                    match Checkpoint::read(&path) {
                        Ok(c) => {
                            evaluate(&c)?;
                            last = Some(step);
                            count += 1;
                            since = std::time::Instant::now();
                            continue;
                        }
                        // Removed by the trainer's manager between the listing and the read
                        // (a newer one was saved): look again.
                        Err(_) if !path.exists() => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
            if since.elapsed() >= self.timeout {
                if self.max_evaluations.is_none() && self.last_step.is_none() {
                    return Ok(count);
                }
                let seen = last.map_or("none yet".to_string(), |s| format!("step {s}"));
                return Err(Error::config(format!(
                    "SidecarEvaluator: no new checkpoint in {} within {:?} (evaluated: {seen}); \
                     is the chief still training and saving there?",
                    self.manager.dir.display(),
                    self.timeout
                )));
            }
            std::thread::sleep(self.poll);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sidecar_evaluator_follows_the_checkpoints_until_the_last_step() {
        use std::time::Duration;
        let dir = std::env::temp_dir().join(format!("tutti-sidecar-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let writer = {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let m = CheckpointManager::new(&dir, 2).unwrap();
                for step in [10u64, 20, 30, 40] {
                    std::thread::sleep(Duration::from_millis(150));
                    let mut c = Checkpoint::new(step);
                    c.insert("w", &Tensor::vector(vec![step as f32; 3]))
                        .unwrap();
                    m.save(&c).unwrap();
                }
            })
        };
        let mut seen = Vec::new();
        let n = SidecarEvaluator::new(&dir)
            .last_step(40)
            .timeout(Duration::from_secs(20))
            .poll_interval(Duration::from_millis(10))
            .run(|c| {
                assert_eq!(c.get::<f32>("w")?.data, vec![c.step() as f32; 3]);
                seen.push(c.step());
                Ok(())
            })
            .unwrap();
        writer.join().unwrap();
        assert_eq!(n, seen.len());
        assert_eq!(seen.last(), Some(&40), "{seen:?}");
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
        // Nothing newer within the timeout: with a bound, an error naming the directory and
        // the last step; without one, the end.
        let e = SidecarEvaluator::new(&dir)
            .max_evaluations(2)
            .timeout(Duration::from_millis(200))
            .run(|_| Ok(()))
            .unwrap_err();
        assert!(
            e.to_string().contains("evaluated: step 40") && e.to_string().contains("tutti-sidecar"),
            "{e}"
        );
        let n = SidecarEvaluator::new(&dir)
            .timeout(Duration::from_millis(200))
            .run(|_| Ok(()))
            .unwrap();
        assert_eq!(n, 1);
        // The evaluation's own error ends it.
        let e = SidecarEvaluator::new(&dir)
            .run(|_| Err(Error::config("the evaluation failed")))
            .unwrap_err();
        assert!(e.to_string().contains("the evaluation failed"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn sample() -> Checkpoint {
        let mut c = Checkpoint::new(50);
        c.insert(
            "w",
            &Tensor::new(vec![1.5f32, -2.0, 3.25, 0.0], vec![2, 2]).unwrap(),
        )
        .unwrap();
        c.insert("step_count", &Tensor::vector(vec![7i64])).unwrap();
        c.insert("empty", &Tensor::<half::bf16>::vector(vec![]))
            .unwrap();
        c
    }

    #[test]
    fn every_type_and_shape_round_trips() {
        let c = Checkpoint::from_bytes(&sample().to_bytes().unwrap(), "t").unwrap();
        assert_eq!(c.step(), 50);
        assert_eq!(c.names().collect::<Vec<_>>(), ["w", "step_count", "empty"]);
        let w = c.get::<f32>("w").unwrap();
        assert_eq!((w.data, w.shape), (vec![1.5, -2.0, 3.25, 0.0], vec![2, 2]));
        assert_eq!(c.get::<i64>("step_count").unwrap().data, [7]);
        assert!(c.get::<half::bf16>("empty").unwrap().data.is_empty());
        let e = c.get::<f64>("w").err().unwrap().to_string();
        assert!(e.contains("saved as f32, read as f64"), "{e}");
        let e = c.get::<f32>("bias").err().unwrap().to_string();
        assert!(e.contains("no such variable") && e.contains("\"w\""), "{e}");
    }

    #[test]
    fn names_are_unique() {
        let mut c = sample();
        let e = c.insert("w", &Tensor::vector(vec![0f32])).err().unwrap();
        assert!(e.to_string().contains("already"), "{e}");
        assert!(c.insert("", &Tensor::vector(vec![0f32])).is_err());
    }

    #[test]
    fn damaged_files_are_refused_with_the_reason() {
        let good = sample().to_bytes().unwrap();
        let refuse = |b: &[u8], want: &str| {
            let e = Checkpoint::from_bytes(b, "f").err().unwrap().to_string();
            assert!(e.contains(want), "{want}: {e}");
        };
        refuse(b"short", "magic");
        refuse(&good[..20], "cut short: 20 bytes");
        refuse(&good[..good.len() - 1], "checksum");
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        refuse(&flipped, "checksum");
        let mut v2 = good.clone();
        v2[8] = 2;
        refuse(&v2, "format version 2");
        // A header whose claims exceed the data, with a checksum that matches: refused by
        // its extent, nothing allocated for it.
        let forge = |header: &str| {
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
            b.extend_from_slice(&(header.len() as u32).to_le_bytes());
            b.extend_from_slice(&[0; 32]);
            b.extend_from_slice(header.as_bytes());
            b.extend_from_slice(&[0; 8]);
            let sum = Sha256::digest(&b[PREAMBLE..]);
            b[16..PREAMBLE].copy_from_slice(&sum);
            b
        };
        let huge = r#"{"step":1,"variables":[{"name":"w","dtype":"f32","shape":[4611686018427387904,4],"offset":0,"bytes":0}]}"#;
        refuse(&forge(huge), "does not fit");
        let past = r#"{"step":1,"variables":[{"name":"w","dtype":"f32","shape":[4],"offset":0,"bytes":16}]}"#;
        refuse(&forge(past), "does not fit");
        let twice = r#"{"step":1,"variables":[{"name":"w","dtype":"u8","shape":[1],"offset":0,"bytes":1},{"name":"w","dtype":"u8","shape":[1],"offset":1,"bytes":1}]}"#;
        refuse(&forge(twice), "repeated");
        refuse(
            &forge(
                r#"{"step":1,"variables":[{"name":"w","dtype":"f128","shape":[1],"offset":0,"bytes":1}]}"#,
            ),
            "f128",
        );
        assert!(Checkpoint::from_bytes(&forge(r#"{"step":1,"variables":[]}"#), "f").is_ok());
    }

    #[test]
    fn a_manager_keeps_the_last_ones_and_restores_the_latest() {
        let dir = std::env::temp_dir().join(format!("tutti-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let m = CheckpointManager::new(&dir, 2).unwrap();
        assert!(m.restore_latest().unwrap().is_none());
        assert!(
            !dir.exists(),
            "a manager that has not saved makes no directory"
        );
        for step in [10u64, 20, 30, 30, 40] {
            let mut c = Checkpoint::new(step);
            c.insert("w", &Tensor::vector(vec![step as f32])).unwrap();
            m.save(&c).unwrap();
        }
        let kept: Vec<u64> = m.checkpoints().unwrap().iter().map(|c| c.0).collect();
        assert_eq!(kept, [30, 40]);
        // An earlier step than the latest there: refused, nothing removed.
        let e = m.save(&Checkpoint::new(20)).err().unwrap().to_string();
        assert!(
            e.contains("holds a later one") && e.contains("ckpt-40.tutti"),
            "{e}"
        );
        // Names this manager does not write are not checkpoints; no temporary files are left.
        for other in [
            "ckpt-+50.tutti",
            "ckpt-060.tutti",
            "ckpt-x.tutti",
            "ckpt-70.tutti.tmp-1-2-3",
        ] {
            std::fs::write(dir.join(other), b"").unwrap();
        }
        let kept: Vec<u64> = m.checkpoints().unwrap().iter().map(|c| c.0).collect();
        assert_eq!(kept, [30, 40]);
        let c = m.restore_latest().unwrap().unwrap();
        assert_eq!(
            (c.step(), c.get::<f32>("w").unwrap().data),
            (40, vec![40.0])
        );
        std::fs::write(dir.join("ckpt-50.tutti"), b"TUTTICKP garbage").unwrap();
        let e = m.restore_latest().err().unwrap().to_string();
        assert!(e.contains("ckpt-50.tutti"), "{e}");
        assert!(CheckpointManager::new(&dir, 0).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
