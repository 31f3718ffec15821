//! Data-parallel training with tutti's strategies: linear regression on synthetic data.
//!
//! Every step each replica computes the gradient of the squared error on its shard of the global
//! batch (the whole data set), the gradients are summed across replicas and divided by the global
//! batch size, and the weights move. The reference is single-device training on the full batch
//! with the same data and steps, so every synchronous strategy must land on the same weights (up
//! to float summation order).
//!
//! ```text
//! cargo run --example train -- --strategy mirrored --replicas 4 --steps 100 --json
//! (parameter-server: the chief runs steps × workers steps, each on one worker's shard)
//! tutti launch -n 2 -- target/debug/examples/train --strategy multi-worker --replicas 2 --json
//! tutti launch --workers 2 --ps 2 -- target/debug/examples/train --strategy parameter-server --json
//! # a worker lost at step 10; the other three shrink and go on (Strategy::shrink)
//! tutti launch --elastic -n 4 -- target/debug/examples/train --strategy multi-worker \
//!     --replicas 1 --steps 30 --elastic --kill-worker 2 --kill-step 10 --json
//! ```
//!
//! `--device cpu|gpu|xla` puts the replicas on logical CPU devices (the default), on the GPUs
//! (`--replicas` at most those present; a build with `--features cuda`), or on the PJRT
//! plugin's first `--replicas` devices (`--features xla`; `--strategy tpu` takes every device).
//! On XLA devices mirrored, one-device, multi-worker and tpu keep the weights in a
//! `DeviceVariable` on the devices, and central-storage in host memory; `xla_host_calls` in the
//! JSON line counts the collectives that went through host memory (none for the first four on
//! one worker).
//!
//! `--checkpoint-dir DIR` saves the weights and the step there at the end (and every
//! `--checkpoint-every` steps; the chief writes, the last 3 are kept); with `--resume` the run
//! first restores the latest and trains `--steps` more, to the reference of all the steps:
//!
//! ```text
//! cargo run --example train -- --steps 50 --checkpoint-dir /tmp/ck
//! cargo run --example train -- --steps 50 --checkpoint-dir /tmp/ck --resume   # = 100 steps
//! ```
//!
//! The `evaluator` task of a TF_CONFIG job runs beside the training as a side-car: it evaluates
//! each checkpoint the chief saves in `--checkpoint-dir` as it appears (the loss on the whole
//! data set), up to the one of step `--steps` (the chief's last step, counted from the start of
//! training), a JSON line (`evaluated_step`, `loss`, `weights`) per evaluation and
//! `evaluations` on the last; each wait for a new checkpoint is bounded by `TUTTI_TIMEOUT`:
//!
//! ```text
//! TF_CONFIG='{"cluster": {"chief": ["localhost:1"], "evaluator": ["localhost:2"]},
//!   "task": {"type": "evaluator", "index": 0}}' train --checkpoint-dir /tmp/ck --steps 100 --json
//! ```
//!
//! With `--json` the last line is
//! `{"strategy", "replicas", "steps", "loss", "weights": [...], "reference_weights": [...],
//! "device", "restored_step", "resumed_at", "resumed_weights"}` (`restored_step`: the
//! checkpoint's step with `--resume`, else null; `reference_weights`: after it plus `steps`).

use clap::Parser;
use tutti::logical_cpus;
use tutti::strategy::ps::{ParameterServerStrategy, Partitioner, Role};
use tutti::strategy::{
    Aggregation, Checkpoint, CheckpointManager, CommunicationImplementation, CrossDeviceOps,
    MirroredVariable, PerReplica, SidecarEvaluator, Strategy, Tensor,
};
use tutti::{ReduceOp, Result};

#[derive(Parser, Clone)]
struct Args {
    /// default, one-device, mirrored, central-storage, multi-worker, parameter-server, tpu.
    #[arg(long, default_value = "mirrored")]
    strategy: String,
    /// Local replicas: logical CPU devices, GPUs or XLA devices (at most those present).
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Where the replicas run: cpu (logical CPU devices), gpu (the GPUs tutti sees; a build
    /// with the cuda feature), xla (the PJRT plugin's devices, TUTTI_PJRT_PLUGIN and
    /// TUTTI_PJRT_OPTIONS; a build with the xla feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Training steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Cross-device ops for mirrored: reduction-to-one, hierarchical-copy, ring.
    #[arg(long)]
    cross_device_ops: Option<String>,
    /// Print the result as JSON on the last line.
    #[arg(long)]
    json: bool,
    /// Every step sleeps this long (parameter servers: in the worker's step; to watch
    /// rescheduling, or a side-car evaluator follow the checkpoints).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// multi-worker: when a step fails because a worker was lost, shrink to the survivors,
    /// restore the weights and the step from the new chief, and go on.
    #[arg(long)]
    elastic: bool,
    /// multi-worker: this worker kills itself (SIGKILL) before step --kill-step (a drill).
    #[arg(long)]
    kill_worker: Option<usize>,
    #[arg(long, default_value_t = 0)]
    kill_step: usize,
    /// multi-worker: start from these weights (comma-separated, as the JSON prints them).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    initial_weights: Option<Vec<f32>>,
    /// Save the weights and the step here at the end (the chief writes; the last 3 are kept).
    #[arg(long)]
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Also save at every multiple of this many steps (0: at the end only).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: usize,
    /// Restore the latest checkpoint of --checkpoint-dir first, then train --steps more.
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
}

/// Checkpoints kept in --checkpoint-dir.
const KEEP: usize = 3;

/// Where a run starts and saves: the step and weights it starts from (restored with
/// `--resume`), and the checkpoint directory.
struct Start {
    step: usize,
    weights: Vec<f32>,
    restored: bool,
    manager: Option<CheckpointManager>,
}

impl Start {
    /// Restore through `strategy` (the chief reads, every worker receives), else from the
    /// directory here (the parameter servers' coordinator).
    fn new(strategy: Option<&Strategy>, args: &Args) -> Result<Start> {
        let manager = args
            .checkpoint_dir
            .as_ref()
            .map(|d| CheckpointManager::new(d, KEEP))
            .transpose()?;
        let mut start = Start {
            step: 0,
            weights: args
                .initial_weights
                .clone()
                .unwrap_or_else(|| vec![0f32; FEATURES + 1]),
            restored: false,
            manager,
        };
        if let (true, Some(m)) = (args.resume, &start.manager) {
            let ckpt = match strategy {
                Some(s) => s.restore_checkpoint(m)?,
                None => m.restore_latest()?,
            }
            .ok_or_else(|| {
                tutti::Error::config(format!(
                    "--resume: no checkpoint in {}",
                    m.directory().display()
                ))
            })?;
            start.weights = ckpt.get::<f32>("weights")?.data;
            if start.weights.len() != FEATURES + 1 {
                return Err(tutti::Error::config(format!(
                    "--resume: the checkpoint's weights have {} values, this model {}",
                    start.weights.len(),
                    FEATURES + 1
                )));
            }
            start.step = usize::try_from(ckpt.step())
                .ok()
                .filter(|s| s.checked_add(args.steps).is_some())
                .ok_or_else(|| {
                    tutti::Error::config(format!(
                        "--resume: the checkpoint's step {} is past counting",
                        ckpt.step()
                    ))
                })?;
            start.restored = true;
        }
        Ok(start)
    }

    /// Whether step `step` saves a checkpoint: the last, and every `--checkpoint-every`.
    fn due(&self, args: &Args, step: usize) -> bool {
        let last = step == self.step + args.steps;
        let periodic = args.checkpoint_every > 0 && step % args.checkpoint_every == 0;
        self.manager.is_some() && (last || periodic)
    }

    /// After `step` (counted from the start of training, across resumes): save where
    /// --checkpoint-dir is given, at the end of the run and at every multiple of
    /// --checkpoint-every.
    fn save(
        &self,
        strategy: Option<&Strategy>,
        args: &Args,
        step: usize,
        weights: &[f32],
    ) -> Result<()> {
        let Some(m) = &self.manager else {
            return Ok(());
        };
        if !self.due(args, step) {
            return Ok(());
        }
        let mut ckpt = Checkpoint::new(step as u64);
        ckpt.insert("weights", &Tensor::vector(weights.to_vec()))?;
        match strategy {
            Some(s) => s.save_checkpoint(m, &ckpt).map(drop),
            None => m.save(&ckpt).map(drop),
        }
    }
}

const SAMPLES: usize = 96;
const FEATURES: usize = 6;
/// Row length: features, then the target.
const ROW: usize = FEATURES + 1;
const LR: f32 = 0.1;

/// The synthetic data set: rows of features and target, y = x·w + b + small noise.
fn data() -> Vec<f32> {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let w_true: Vec<f32> = (0..FEATURES).map(|i| 0.5 + i as f32 * 0.25).collect();
    let mut rows = Vec::with_capacity(SAMPLES * ROW);
    for _ in 0..SAMPLES {
        let x: Vec<f32> = (0..FEATURES).map(|_| next()).collect();
        let y = x.iter().zip(&w_true).map(|(a, b)| a * b).sum::<f32>() - 0.75 + 0.01 * next();
        rows.extend_from_slice(&x);
        rows.push(y);
    }
    rows
}

/// Sum over `rows` of the squared-error gradient (weights then bias) and of the squared error.
fn grad_sum(weights: &[f32], rows: &[f32]) -> (Vec<f32>, f32) {
    let mut g = vec![0f32; FEATURES + 1];
    let mut loss = 0f32;
    for row in rows.chunks(ROW) {
        let (x, y) = (&row[..FEATURES], row[FEATURES]);
        let pred = x.iter().zip(weights).map(|(a, b)| a * b).sum::<f32>() + weights[FEATURES];
        let err = pred - y;
        loss += err * err;
        for (gi, xi) in g.iter_mut().zip(x) {
            *gi += 2.0 * err * xi;
        }
        g[FEATURES] += 2.0 * err;
    }
    (g, loss)
}

/// Single-device training on the full batch.
fn reference(steps: usize) -> (Vec<f32>, f32) {
    let rows = data();
    let mut w = vec![0f32; FEATURES + 1];
    let mut loss = 0.0;
    for _ in 0..steps {
        let (g, l) = grad_sum(&w, &rows);
        loss = l / SAMPLES as f32;
        w.iter_mut()
            .zip(&g)
            .for_each(|(wi, gi)| *wi -= LR * gi / SAMPLES as f32);
    }
    (w, loss)
}

fn scaled(g: &[f32]) -> Vec<f32> {
    g.iter().map(|x| LR * x / SAMPLES as f32).collect()
}

/// Mirrored variables: every replica updates its copy with the SUM of the replicas' updates.
fn train_mirrored(strategy: &Strategy, args: &Args) -> Result<((Vec<f32>, f32), Start)> {
    let start = Start::new(Some(strategy), args)?;
    let shards = strategy.distribute_batch(&data(), ROW)?;
    let w = strategy.mirrored_variable(&start.weights)?;
    let mut loss = 0.0;
    for step in start.step + 1..=start.step + args.steps {
        std::thread::sleep(std::time::Duration::from_millis(args.step_delay_ms));
        loss = mirrored_step(strategy, &shards, &w)?;
        start.save(Some(strategy), args, step, &w.value())?;
    }
    assert!(w.in_sync(), "mirrored copies diverged");
    Ok(((w.value(), loss), start))
}

/// One step on mirrored weights: each replica's update from its shard, summed; the loss.
fn mirrored_step(
    strategy: &Strategy,
    shards: &PerReplica<Vec<f32>>,
    w: &MirroredVariable<f32>,
) -> Result<f32> {
    let losses = strategy.run(|ctx| {
        let (g, l) = grad_sum(&w.read_in(ctx), &shards.0[ctx.local_replica_id()]);
        ctx.assign_sub(w, &scaled(&g), Aggregation::Sum)?;
        let mut l = [l / SAMPLES as f32];
        ctx.all_reduce(ReduceOp::Sum, &mut l)?;
        Ok(l[0])
    })?;
    Ok(losses.0[0])
}

/// Mirrored weights on the replicas' XLA devices: a `DeviceVariable`. Each replica
/// reads its copy, places its update on its device, and the sum of the updates is subtracted
/// from every copy in one program there; the loss is summed on the devices too, so no
/// collective goes through host memory.
fn train_on_devices(strategy: &Strategy, args: &Args) -> Result<((Vec<f32>, f32), Start)> {
    let start = Start::new(Some(strategy), args)?;
    let shards = strategy.distribute_batch(&data(), ROW)?;
    let w = strategy.device_variable(&start.weights)?;
    let mut loss = 0.0;
    for step in start.step + 1..=start.step + args.steps {
        std::thread::sleep(std::time::Duration::from_millis(args.step_delay_ms));
        let losses = strategy.run(|ctx| {
            let me = ctx.local_replica_id();
            let (g, l) = grad_sum(&w.read(me)?, &shards.0[me]);
            w.assign_sub_in(ctx, &ctx.place(&scaled(&g))?, Aggregation::Sum)?;
            let mut l = ctx.place(&[l / SAMPLES as f32])?;
            ctx.all_reduce_tensor(ReduceOp::Sum, &mut l)?;
            Ok(l.to_vec::<f32>()?[0])
        })?;
        loss = losses.0[0];
        if start.due(args, step) {
            start.save(Some(strategy), args, step, &w.value()?)?;
        }
    }
    assert!(w.in_sync()?, "the copies on the devices diverged");
    Ok(((w.value()?, loss), start))
}

/// What a multi-worker run that lost a worker went on from: the step it repeated and the
/// weights the new chief broadcast.
type Resumed = Option<(usize, Vec<f32>)>;

/// [`train_on_devices`], counting in `host_calls` the collectives of the strategy's XLA client
/// that went through host memory meanwhile.
fn on_devices(
    strategy: &Strategy,
    args: &Args,
    host_calls: &mut Option<u64>,
) -> Result<((Vec<f32>, f32), Start)> {
    let before = xla_host_calls(strategy);
    let r = train_on_devices(strategy, args)?;
    *host_calls = xla_host_calls(strategy).zip(before).map(|(a, b)| a - b);
    Ok(r)
}

/// Multi-worker training that can lose a worker (`--elastic`): a step that fails shrinks the
/// strategy to the survivors, which take the new chief's weights and step and go on.
fn train_multi_worker(
    strategy: &mut Strategy,
    args: &Args,
) -> Result<((Vec<f32>, f32), Start, Resumed)> {
    let start = Start::new(Some(strategy), args)?;
    let mut shards = strategy.distribute_batch(&data(), ROW)?;
    let mut w = strategy.mirrored_variable(&start.weights)?;
    let (mut step, mut loss, mut resumed) = (start.step, 0.0, None);
    while step < start.step + args.steps {
        std::thread::sleep(std::time::Duration::from_millis(args.step_delay_ms));
        let me = strategy.cluster_resolver().task_id;
        if resumed.is_none() && args.kill_worker == Some(me) && step == args.kill_step {
            // SAFETY: plain syscall; the process ends here.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        // A step, then its checkpoint (a collective too): either fails when a worker is lost.
        // A step that completed here counts even where its save failed: the chief's step and
        // weights, broadcast after the shrink, agree.
        let done = mirrored_step(strategy, &shards, &w).and_then(|l| {
            loss = l;
            step += 1;
            start.save(Some(strategy), args, step, &w.value())
        });
        match done {
            Ok(()) => {}
            Err(e) if args.elastic => {
                eprintln!("train: step {step} failed ({e}); going on with the survivors");
                strategy.shrink()?;
                shards = strategy.distribute_batch(&data(), ROW)?;
                // The chief's weights and step: the failed step may have completed elsewhere.
                w = strategy.mirrored_variable(&w.value())?;
                step = strategy.broadcast_from_chief(&[step as u64])?[0] as usize;
                resumed = Some((step, w.value()));
            }
            Err(e) => return Err(e),
        }
    }
    assert!(w.in_sync(), "mirrored copies diverged");
    Ok(((w.value(), loss), start, resumed))
}

/// Central storage: one copy of the weights; the replicas' updates are reduced onto it.
fn train_central(strategy: &Strategy, args: &Args) -> Result<((Vec<f32>, f32), Start)> {
    let start = Start::new(Some(strategy), args)?;
    let shards = strategy.distribute_batch(&data(), ROW)?;
    let w = strategy.central_variable(&start.weights)?;
    let mut loss = 0.0;
    for step in start.step + 1..=start.step + args.steps {
        std::thread::sleep(std::time::Duration::from_millis(args.step_delay_ms));
        let weights = w.value();
        let out = strategy.run(|ctx| {
            let (g, l) = grad_sum(&weights, &shards.0[ctx.local_replica_id()]);
            Ok((scaled(&g), l / SAMPLES as f32))
        })?;
        let (updates, losses): (Vec<_>, Vec<_>) = out.0.into_iter().unzip();
        w.assign_sub(strategy, &PerReplica(updates), Aggregation::Sum)?;
        let losses = PerReplica(
            losses
                .into_iter()
                .map(|l| Tensor::vector(vec![l]))
                .collect(),
        );
        loss = strategy.reduce(ReduceOp::Sum, &losses, None)?.data[0];
        start.save(Some(strategy), args, step, &w.value())?;
    }
    Ok(((w.value(), loss), start))
}

/// Final weights and loss, the number of replicas (workers) that trained them, and where the
/// run started.
type Trained = ((Vec<f32>, f32), usize, Start);

/// Parameter servers: the chief schedules steps; workers pull the weights, push gradients.
fn train_ps(args: &Args) -> Result<Option<Trained>> {
    let step_delay = std::time::Duration::from_millis(args.step_delay_ms);
    let strategy = ParameterServerStrategy::from_env(Partitioner::MaxShards(2))?;
    let rows = data();
    let role = strategy.run_role(move |ctx| {
        std::thread::sleep(step_delay);
        // Each step uses the worker's shard of the batch for this step (round-robin).
        let workers = ctx.num_workers();
        let shard = tutti::partition(SAMPLES, workers, (ctx.step() as usize) % workers);
        let w = ctx.variables()[0]
            .as_f32()
            .ok_or_else(|| tutti::Error::config("the weights are f32"))?;
        let (g, l) = grad_sum(w, &rows[shard.start * ROW..shard.end * ROW]);
        let n = shard.len().max(1) as f32;
        Ok((
            vec![g.iter().map(|x| x / n).collect::<Vec<f32>>().into()],
            l / n,
        ))
    })?;
    match role {
        Role::Chief(coord) => {
            // The coordinator alone holds the variables: it restores and saves them, whole,
            // so a checkpoint restores onto any number of parameter servers.
            let start = Start::new(None, args)?;
            let w = coord.create_variable("weights", &start.weights, LR)?;
            let workers = coord.num_workers();
            // A step here is one pass over every worker's shard: `workers` scheduled steps.
            let (mut step, mut loss, end) = (start.step, 0.0, start.step + args.steps);
            while step < end {
                // Up to the next multiple of --checkpoint-every, or the end.
                let n = match args.checkpoint_every {
                    0 => end - step,
                    k => (k - step % k).min(end - step),
                };
                loss = *coord.run_steps(n * workers)?.last().unwrap_or(&loss);
                step += n;
                start.save(None, args, step, &coord.read_variable(w)?)?;
            }
            let weights = coord.read_variable(w)?;
            coord.shutdown()?;
            Ok(Some(((weights, loss), workers, start)))
        }
        Role::Done => Ok(None),
    }
}

/// TPUStrategy over the XLA devices of the PJRT plugin found (TUTTI_PJRT_PLUGIN,
/// TUTTI_PJRT_OPTIONS; e.g. the CPU plugin with `cpu_device_count=4`).
#[cfg(feature = "xla")]
fn tpu_strategy() -> Result<Strategy> {
    Strategy::tpu(tutti::xla::Client::from_env()?)
}

#[cfg(not(feature = "xla"))]
fn tpu_strategy() -> Result<Strategy> {
    Err(no_xla("TPUStrategy"))
}

#[cfg(not(feature = "xla"))]
fn no_xla(what: &str) -> tutti::Error {
    tutti::Error::Unavailable {
        what: what.into(),
        why: "this example was built without the xla feature (cargo build --features xla --example train)".into(),
    }
}

/// How many collectives the client of `strategy`'s XLA devices has run on host memory so far
/// (`None` off XLA devices).
#[cfg(feature = "xla")]
fn xla_host_calls(strategy: &Strategy) -> Option<u64> {
    strategy.xla_client().map(|c| c.cache_stats().host_calls)
}

#[cfg(not(feature = "xla"))]
fn xla_host_calls(_: &Strategy) -> Option<u64> {
    None
}

/// tutti reports through the `log` facade; this program shows its records on stderr up to the
/// level `TUTTI_LOG` names (`error`, `warn`, `info`, `debug`, `trace`, `off`; default `warn`),
/// as the `tutti` command does.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, meta: &log::Metadata<'_>) -> bool {
        meta.level() <= log::max_level()
    }
    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            eprintln!("tutti: {}", record.args());
        }
    }
    fn flush(&self) {}
}

fn main() -> std::process::ExitCode {
    static LOG: StderrLog = StderrLog;
    let level = match std::env::var("TUTTI_LOG") {
        Err(_) => log::LevelFilter::Warn,
        Ok(v) => match v.trim().parse::<log::LevelFilter>() {
            Ok(l) => l,
            Err(_) => {
                eprintln!(
                    "train: TUTTI_LOG='{v}': expected error, warn, info, debug, trace or off"
                );
                return std::process::ExitCode::FAILURE;
            }
        },
    };
    let _ = log::set_logger(&LOG);
    log::set_max_level(level);
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The devices `--device` and `--replicas` ask for.
fn local_devices(args: &Args) -> Result<Vec<tutti::Device>> {
    match args.device.as_str() {
        "cpu" => logical_cpus(args.replicas.max(1)),
        #[cfg(not(feature = "xla"))]
        "xla" => Err(no_xla("--device xla")),
        #[cfg(feature = "xla")]
        "xla" => {
            let devices: Vec<tutti::Device> = tutti::discover_devices()
                .into_iter()
                .filter(|d| d.kind == tutti::DeviceKind::Xla)
                .collect();
            if devices.len() < args.replicas.max(1) {
                return Err(tutti::Error::config(format!(
                    "--device xla --replicas {}: the PJRT plugin has {} device(s) here \
                     (TUTTI_PJRT_PLUGIN names the plugin; the CPU plugin takes \
                     TUTTI_PJRT_OPTIONS=cpu_device_count=N)",
                    args.replicas,
                    devices.len()
                )));
            }
            Ok(devices.into_iter().take(args.replicas.max(1)).collect())
        }
        "gpu" => {
            let gpus: Vec<tutti::Device> = tutti::discover_devices()
                .into_iter()
                .filter(|d| d.kind == tutti::DeviceKind::Gpu)
                .collect();
            if gpus.is_empty() {
                return Err(tutti::Error::Unavailable {
                    what: "--device gpu".into(),
                    why: "tutti sees no GPU here (no CUDA driver or GPU, or a build without the \
                          cuda feature: cargo build --features cuda --example train)"
                        .into(),
                });
            }
            if args.replicas > gpus.len() {
                return Err(tutti::Error::config(format!(
                    "--device gpu --replicas {}: {} GPU(s) here",
                    args.replicas,
                    gpus.len()
                )));
            }
            Ok(gpus.into_iter().take(args.replicas.max(1)).collect())
        }
        other => Err(tutti::Error::config(format!(
            "--device {other}: expected cpu, gpu or xla"
        ))),
    }
}

/// The `evaluator` task of TF_CONFIG: a side-car that evaluates each checkpoint the chief
/// saves in --checkpoint-dir (its loss on the whole data set), up to the one of step --steps
/// (the chief's last: with --resume, the restored step plus its --steps); a JSON line per
/// evaluation, the last with the count. Each wait for a new checkpoint is bounded by
/// TUTTI_TIMEOUT: save often enough (--checkpoint-every).
fn evaluate(args: &Args) -> Result<()> {
    let dir = args.checkpoint_dir.as_ref().ok_or_else(|| {
        tutti::Error::config(
            "the evaluator task evaluates the checkpoints of --checkpoint-dir: give it",
        )
    })?;
    let rows = data();
    let mut last = None;
    let count = SidecarEvaluator::new(dir)
        .last_step(args.steps as u64)
        .run(|ckpt| {
            let weights = ckpt.get::<f32>("weights")?.data;
            if weights.len() != FEATURES + 1 {
                return Err(tutti::Error::config(format!(
                    "checkpoint of step {}: {} weights, this model {}",
                    ckpt.step(),
                    weights.len(),
                    FEATURES + 1
                )));
            }
            let loss = grad_sum(&weights, &rows).1 / SAMPLES as f32;
            let line = serde_json::json!({
                "evaluated_step": ckpt.step(), "loss": loss, "weights": weights,
            });
            if args.json {
                println!("{line}");
            } else {
                println!("step {}: loss {loss:.6}", ckpt.step());
            }
            last = Some(line);
            Ok(())
        })?;
    if let (true, Some(mut line)) = (args.json, last) {
        line["evaluations"] = count.into();
        println!("{line}");
    }
    Ok(())
}

fn run(args: &Args) -> Result<()> {
    if tutti::ClusterSpec::from_env()?.is_some_and(|s| s.task_type == "evaluator") {
        return evaluate(args);
    }
    let xla = args.device == "xla" || args.strategy == "tpu";
    if xla && matches!(args.strategy.as_str(), "default" | "parameter-server") {
        return Err(tutti::Error::config(format!(
            "--device xla: --strategy {} keeps its variables in host memory; on XLA devices \
             run mirrored, one-device, central-storage, multi-worker or tpu",
            args.strategy
        )));
    }
    if xla && (args.elastic || args.kill_worker.is_some()) {
        return Err(tutti::Error::config(
            "--device xla: --elastic and --kill-worker run on CPU devices (the XLA training \
             here does not shrink)",
        ));
    }
    if xla && args.cross_device_ops.is_some() {
        return Err(tutti::Error::config(
            "--device xla: the replicas reduce with XLA's own collectives; --cross-device-ops \
             is for CPU and GPU devices",
        ));
    }
    // TPUStrategy takes every device of the plugin; OneDeviceStrategy the first.
    let devices = match args.strategy.as_str() {
        "tpu" => Vec::new(),
        "one-device" => local_devices(&Args {
            replicas: 1,
            ..args.clone()
        })?,
        _ => local_devices(args)?,
    };
    if args.device == "gpu" && args.strategy == "parameter-server" {
        return Err(tutti::Error::config(
            "--device gpu: the parameter servers here keep their variables in host memory",
        ));
    }
    let mut resumed: Resumed = None;
    let mut host_calls = None;
    let (result, replicas, start) = match args.strategy.as_str() {
        "default" => {
            let s = Strategy::default_strategy();
            let (r, start) = train_mirrored(&s, args)?;
            (r, s.num_replicas_in_sync(), start)
        }
        "tpu" => {
            let s = tpu_strategy()?;
            let (r, start) = on_devices(&s, args, &mut host_calls)?;
            (r, s.num_replicas_in_sync(), start)
        }
        "one-device" => {
            let s = Strategy::one_device(devices[0].clone())?;
            let (r, start) = if xla {
                on_devices(&s, args, &mut host_calls)?
            } else {
                train_mirrored(&s, args)?
            };
            (r, s.num_replicas_in_sync(), start)
        }
        "mirrored" if xla => {
            let s = Strategy::mirrored(&devices, None)?;
            let (r, start) = on_devices(&s, args, &mut host_calls)?;
            (r, s.num_replicas_in_sync(), start)
        }
        "mirrored" => {
            let ops = match args.cross_device_ops.as_deref() {
                None => None,
                Some("reduction-to-one") => Some(CrossDeviceOps::ReductionToOneDevice { reduce_to_device: None }),
                Some("hierarchical-copy") => Some(CrossDeviceOps::HierarchicalCopyAllReduce { num_packs: 1, group_size: 2 }),
                Some("ring") => Some(CrossDeviceOps::Ring),
                Some(o) => return Err(tutti::Error::config(format!("--cross-device-ops {o}: unknown"))),
            };
            let s = Strategy::mirrored(&devices, ops)?;
            let (r, start) = train_mirrored(&s, args)?;
            (r, s.num_replicas_in_sync(), start)
        }
        "central-storage" => {
            let s = Strategy::central_storage(&devices)?;
            let before = xla_host_calls(&s);
            let (r, start) = train_central(&s, args)?;
            host_calls = xla_host_calls(&s).zip(before).map(|(a, b)| a - b);
            (r, s.num_replicas_in_sync(), start)
        }
        "multi-worker" if xla => {
            let s = Strategy::multi_worker_mirrored(CommunicationImplementation::Auto, None, &devices)?;
            let (r, start) = on_devices(&s, args, &mut host_calls)?;
            (r, s.num_replicas_in_sync(), start)
        }
        "multi-worker" => {
            let mut s = Strategy::multi_worker_mirrored(CommunicationImplementation::Auto, None, &devices)?;
            let (r, start, at) = train_multi_worker(&mut s, args)?;
            resumed = at;
            (r, s.num_replicas_in_sync(), start)
        }
        "parameter-server" => match train_ps(args)? {
            Some(r) => r,
            None => return Ok(()),
        },
        other => {
            return Err(tutti::Error::config(format!(
                "--strategy {other}: expected default, one-device, mirrored, central-storage, multi-worker, parameter-server or tpu"
            )))
        }
    };
    let ((weights, loss), (reference_weights, _)) = (result, reference(start.step + args.steps));
    let device = if xla { "xla" } else { args.device.as_str() };
    if args.json {
        let line = serde_json::json!({
            "strategy": args.strategy,
            "replicas": replicas,
            "steps": args.steps,
            "loss": loss,
            "weights": weights,
            "reference_weights": reference_weights,
            "device": device,
            "restored_step": start.restored.then_some(start.step),
            "resumed_at": resumed.as_ref().map(|r| r.0),
            "resumed_weights": resumed.as_ref().map(|r| r.1.clone()),
            "xla_host_calls": host_calls,
        });
        println!("{line}");
    } else {
        println!(
            "{} with {replicas} replicas, {} steps: loss {loss:.6}",
            args.strategy, args.steps
        );
        println!("weights   {weights:?}");
        println!("reference {reference_weights:?}");
    }
    Ok(())
}
