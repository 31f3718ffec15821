//! Strategy-aware training pieces, as Keras's are under tf.distribute: an [`Optimizer`] whose
//! `apply_gradients` sums the replicas' gradients before it steps every copy of a
//! [`MirroredVariable`] alike, [`compute_average_loss`], and metrics read across replicas
//! ([`Mean`], sync on read).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{MirroredVariable, PerReplica, ReplicaContext, Strategy, Tensor};
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};

/// TensorFlow's `tf.nn.compute_average_loss`: the sum of this replica's per-example losses over
/// the global batch size, so that the gradients summed across replicas are those of the global
/// batch's mean loss.
pub fn compute_average_loss(per_example_loss: &[f32], global_batch_size: usize) -> Result<f32> {
    if global_batch_size == 0 {
        return Err(Error::config(
            "compute_average_loss: global_batch_size must be positive",
        ));
    }
    Ok(per_example_loss.iter().sum::<f32>() / global_batch_size as f32)
}

/// How an [`Optimizer`] turns the summed gradient into a step (Keras's update rules).
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Rule {
    /// `w -= lr * g`; with `momentum`, `v = momentum * v - lr * g; w += v` (`nesterov`:
    /// `w += momentum * v - lr * g`).
    Sgd {
        /// Learning rate.
        learning_rate: f32,
        /// Momentum (0: plain SGD).
        momentum: f32,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam: moments `m`, `v`; the step `lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) +
    /// epsilon)`.
    Adam {
        /// Learning rate.
        learning_rate: f32,
        /// First moment's decay.
        beta_1: f32,
        /// Second moment's decay.
        beta_2: f32,
        /// Added to the root of the second moment.
        epsilon: f32,
    },
}

/// One copy's slots.
#[derive(Default)]
struct Slots {
    a: Vec<f32>,
    b: Vec<f32>,
    steps: i32,
}

type SharedSlots = std::sync::Arc<Mutex<Slots>>;

/// A strategy-aware optimizer for f32 [`MirroredVariable`]s. Inside [`Strategy::run`],
/// [`Optimizer::apply_gradients`] sums each gradient across every replica in sync (one fused
/// all-reduce: compute the loss with [`compute_average_loss`] so the sum is the global batch's
/// gradient), then steps the replica's copy of each variable; every copy keeps its own slots,
/// updated alike, so the copies stay identical.
pub struct Optimizer {
    rule: Rule,
    /// Per variable and copy; each its own lock, so the replicas step their copies at once.
    slots: Mutex<HashMap<(u64, usize), SharedSlots>>,
    iterations: AtomicU64,
}

impl Optimizer {
    /// An optimizer with `rule`; a learning rate that is not positive is an error.
    pub fn new(rule: Rule) -> Result<Optimizer> {
        let lr = match rule {
            Rule::Sgd { learning_rate, .. } | Rule::Adam { learning_rate, .. } => learning_rate,
        };
        if lr.is_nan() || lr <= 0.0 {
            return Err(Error::config(format!(
                "optimizer: learning rate {lr} must be positive"
            )));
        }
        Ok(Optimizer {
            rule,
            slots: Mutex::new(HashMap::new()),
            iterations: AtomicU64::new(0),
        })
    }

    /// Plain SGD.
    pub fn sgd(learning_rate: f32) -> Result<Optimizer> {
        Optimizer::new(Rule::Sgd {
            learning_rate,
            momentum: 0.0,
            nesterov: false,
        })
    }

    /// Adam with Keras's defaults but the learning rate (0.9, 0.999, 1e-7).
    pub fn adam(learning_rate: f32) -> Result<Optimizer> {
        Optimizer::new(Rule::Adam {
            learning_rate,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-7,
        })
    }

    /// Steps taken (one per `apply_gradients` of the replicas in sync), on every worker.
    pub fn iterations(&self) -> u64 {
        self.iterations.load(Ordering::Relaxed)
    }

    /// Sum `grads_and_vars`' gradients across every replica in sync and step the replica's
    /// copy of each variable by them. Collective: every replica calls it with the same
    /// variables in the same order. A gradient whose length differs from its variable's is an
    /// error before anything is summed.
    pub fn apply_gradients(
        &self,
        ctx: &ReplicaContext<'_>,
        grads_and_vars: &[(&[f32], &MirroredVariable<f32>)],
    ) -> Result<()> {
        for (k, (g, v)) in grads_and_vars.iter().enumerate() {
            if g.len() != v.len() {
                return Err(Error::config(format!(
                    "apply_gradients: gradient {k} holds {} elements, its variable {}",
                    g.len(),
                    v.len()
                )));
            }
        }
        let mut sums: Vec<Vec<f32>> = grads_and_vars.iter().map(|(g, _)| g.to_vec()).collect();
        let mut bufs: Vec<&mut [f32]> = sums.iter_mut().map(|g| g.as_mut_slice()).collect();
        ctx.all_reduce_batch(ReduceOp::Sum, &mut bufs)?;
        let me = ctx.local_replica_id();
        for (g, (_, var)) in sums.iter().zip(grads_and_vars) {
            let slots = self.slots.lock().entry((var.id(), me)).or_default().clone();
            var.update_copy(me, |w| self.step(&mut slots.lock(), w, g));
        }
        if me == 0 {
            // Once per step on every worker (its first local replica).
            self.iterations.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn step(&self, s: &mut Slots, w: &mut [f32], g: &[f32]) {
        if s.a.len() != w.len() {
            (s.a, s.b) = (vec![0.0; w.len()], vec![0.0; w.len()]);
        }
        match self.rule {
            Rule::Sgd {
                learning_rate: lr,
                momentum,
                nesterov,
            } => {
                for ((w, &g), v) in w.iter_mut().zip(g).zip(&mut s.a) {
                    if momentum == 0.0 {
                        *w -= lr * g;
                        continue;
                    }
                    *v = momentum * *v - lr * g;
                    *w += if nesterov { momentum * *v - lr * g } else { *v };
                }
            }
            Rule::Adam {
                learning_rate: lr,
                beta_1,
                beta_2,
                epsilon,
            } => {
                s.steps = s.steps.saturating_add(1);
                let t = s.steps;
                let lr_t = lr * (1.0 - beta_2.powi(t)).sqrt() / (1.0 - beta_1.powi(t));
                for (((w, &g), m), v) in w.iter_mut().zip(g).zip(&mut s.a).zip(&mut s.b) {
                    *m = beta_1 * *m + (1.0 - beta_1) * g;
                    *v = beta_2 * *v + (1.0 - beta_2) * g * g;
                    *w -= lr_t * *m / (v.sqrt() + epsilon);
                }
            }
        }
    }
}

/// The mean of values observed by every replica, read across replicas (TensorFlow's
/// sync on read): each local replica accumulates its own total and count inside
/// [`Strategy::run`], and [`Mean::result`] sums them over every replica in sync.
pub struct Mean {
    states: Vec<Mutex<[f64; 2]>>,
}

impl Mean {
    /// A metric for `strategy`'s replicas.
    pub fn new(strategy: &Strategy) -> Mean {
        Mean {
            states: (0..strategy.num_local_replicas())
                .map(|_| Mutex::new([0.0; 2]))
                .collect(),
        }
    }

    /// Observe `values` on the replica running `ctx`.
    pub fn update_state(&self, ctx: &ReplicaContext<'_>, values: &[f32]) {
        let mut s = self.states[ctx.local_replica_id()].lock();
        s[0] += values.iter().map(|&v| f64::from(v)).sum::<f64>();
        s[1] += values.len() as f64;
    }

    /// The mean over every replica's observations, every worker's (0 before any). Call it
    /// outside `run`; collective across workers.
    pub fn result(&self, strategy: &Strategy) -> Result<f64> {
        let parts = PerReplica(
            self.states
                .iter()
                .map(|s| Tensor::vector(s.lock().to_vec()))
                .collect(),
        );
        let total = strategy.reduce(ReduceOp::Sum, &parts, None)?;
        Ok(if total.data[1] > 0.0 {
            total.data[0] / total.data[1]
        } else {
            0.0
        })
    }

    /// Back to no observations.
    pub fn reset_state(&self) {
        for s in &self.states {
            *s.lock() = [0.0; 2];
        }
    }
}
