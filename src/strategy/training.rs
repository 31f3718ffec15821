//! Strategy-aware training pieces, as Keras's are under tf.distribute: an [`Optimizer`] whose
//! `apply_gradients` sums the replicas' gradients before it steps every copy of a
//! [`MirroredVariable`] alike (`apply_device_gradients`: a [`DeviceVariable`]'s copies, on
//! their devices), [`compute_average_loss`], and metrics read across replicas ([`Mean`], sync
//! on read).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::ps::Values;
use super::{
    CentralVariable, Checkpoint, DeviceVariable, MirroredVariable, PerReplica, ReplicaContext,
    Strategy, Tensor,
};
use crate::device::DeviceTensor;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Collective, Error, Result};

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

/// The arithmetic an update [`Rule`] runs in: f32 for f32, f16 and bf16 variables (their slots
/// are f32, as in mixed precision), f64 for f64 ones.
pub trait Compute:
    Copy
    + Default
    + PartialEq
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + Send
    + 'static
{
    /// A rule's hyper-parameter (an f32) in this arithmetic.
    fn of(x: f32) -> Self;
    /// The square root.
    fn sqrt(self) -> Self;
    /// `self` to the power `n`.
    fn powi(self, n: i32) -> Self;
}

impl Compute for f32 {
    fn of(x: f32) -> f32 {
        x
    }
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
    fn powi(self, n: i32) -> f32 {
        f32::powi(self, n)
    }
}

impl Compute for f64 {
    fn of(x: f32) -> f64 {
        x as f64
    }
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
    fn powi(self, n: i32) -> f64 {
        f64::powi(self, n)
    }
}

/// An element type an update [`Rule`] steps: the floats (f32, f64, f16, bf16).
pub trait Param: crate::dtype::Element {
    /// What the rule computes in.
    type C: Compute;
    /// The element in the rule's arithmetic.
    fn load(self) -> Self::C;
    /// The nearest element to a result of the rule's arithmetic.
    fn store(c: Self::C) -> Self;
    /// The slots of this arithmetic among a copy's.
    #[doc(hidden)]
    fn slots(s: &mut AnySlots) -> &mut Slots<Self::C>;
    /// Run `f` over `w` and `g` in the rule's arithmetic, a stretch at a time (`f(at, w, g)`:
    /// elements from `at`), and keep what it leaves in `w`: in place where the element is the
    /// arithmetic's own type, through converted stretches where it is not.
    #[doc(hidden)]
    fn in_compute(w: &mut [Self], g: &[Self], f: &mut Stretch<'_, Self::C>);
}

/// What [`Param::in_compute`] runs over each stretch: `f(at, w, g)`, elements from `at`.
#[doc(hidden)]
pub type Stretch<'a, C> = dyn FnMut(usize, &mut [C], &[C]) + 'a;

/// Elements a half-precision stretch is converted in (two f32 buffers of it on the stack).
const STRETCH: usize = 2048;

/// [`Param::in_compute`] for f16 and bf16: stretches converted to f32 and back with the
/// `half` crate's slice conversions (vectorised where the CPU allows).
fn half_in_compute<H>(w: &mut [H], g: &[H], f: &mut Stretch<'_, f32>)
where
    [H]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    let (mut wb, mut gb) = ([0f32; STRETCH], [0f32; STRETCH]);
    for (k, (w, g)) in w.chunks_mut(STRETCH).zip(g.chunks(STRETCH)).enumerate() {
        let n = w.len().min(g.len());
        let (wb, gb) = (&mut wb[..n], &mut gb[..n]);
        w[..n].convert_to_f32_slice(wb);
        g[..n].convert_to_f32_slice(gb);
        f(k * STRETCH, wb, gb);
        w[..n].convert_from_f32_slice(wb);
    }
}

impl Param for f32 {
    type C = f32;
    fn load(self) -> f32 {
        self
    }
    fn store(c: f32) -> f32 {
        c
    }
    fn slots(s: &mut AnySlots) -> &mut Slots<f32> {
        &mut s.f32
    }
    fn in_compute(w: &mut [f32], g: &[f32], f: &mut Stretch<'_, f32>) {
        f(0, w, g)
    }
}

impl Param for f64 {
    type C = f64;
    fn load(self) -> f64 {
        self
    }
    fn store(c: f64) -> f64 {
        c
    }
    fn slots(s: &mut AnySlots) -> &mut Slots<f64> {
        &mut s.f64
    }
    fn in_compute(w: &mut [f64], g: &[f64], f: &mut Stretch<'_, f64>) {
        f(0, w, g)
    }
}

impl Param for half::f16 {
    type C = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(c: f32) -> half::f16 {
        half::f16::from_f32(c)
    }
    fn slots(s: &mut AnySlots) -> &mut Slots<f32> {
        &mut s.f32
    }
    fn in_compute(w: &mut [Self], g: &[Self], f: &mut Stretch<'_, f32>) {
        half_in_compute(w, g, f)
    }
}

impl Param for half::bf16 {
    type C = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(c: f32) -> half::bf16 {
        half::bf16::from_f32(c)
    }
    fn slots(s: &mut AnySlots) -> &mut Slots<f32> {
        &mut s.f32
    }
    fn in_compute(w: &mut [Self], g: &[Self], f: &mut Stretch<'_, f32>) {
        half_in_compute(w, g, f)
    }
}

/// One copy's slots (momentum, or Adam's moments and step count), in the rule's arithmetic.
#[doc(hidden)]
#[derive(Clone)]
pub struct Slots<C> {
    a: Vec<C>,
    b: Vec<C>,
    steps: i32,
}

impl<C> Default for Slots<C> {
    fn default() -> Slots<C> {
        Slots {
            a: Vec::new(),
            b: Vec::new(),
            steps: 0,
        }
    }
}

/// A copy's slots, whichever arithmetic its variable's dtype uses.
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct AnySlots {
    f32: Slots<f32>,
    f64: Slots<f64>,
}

type SharedSlots = std::sync::Arc<Mutex<AnySlots>>;

/// One copy's slots when its variable is a [`DeviceVariable`].
#[derive(Default)]
struct DeviceSlots {
    /// On an XLA device: the rule's slots there, then Adam's powers `[b1^t, b2^t]` (see
    /// `pjrt::program::Step`); empty until the copy's first step.
    state: Vec<DeviceTensor>,
    /// Adam's steps taken by `state`.
    steps: u32,
    /// On an XLA device: the learning rate there (one element of the step's arithmetic), the
    /// program's argument, and the bits of the f32 rate it holds; uploaded again when the rate
    /// changes.
    #[cfg(feature = "xla")]
    rate: Option<(u32, crate::device::pjrt::XlaBuffer)>,
    /// A copy in host memory steps these (as a [`MirroredVariable`]'s copy does); on a
    /// device, what a restore gave, taken there at the first step.
    host: AnySlots,
}

type SharedDeviceSlots = std::sync::Arc<Mutex<DeviceSlots>>;

impl DeviceSlots {
    /// The state `rule` keeps here for a variable of `len` elements (`wide`: f64 arithmetic),
    /// copied from the device where it is there.
    fn export(&self, rule: &Rule, len: usize, wide: bool) -> Result<SlotState> {
        if self.state.is_empty() {
            return Ok(self.host.export(rule, len, wide));
        }
        let (a, b) = rule.slots_used();
        let read = |t: &DeviceTensor| -> Result<Values> {
            Ok(if wide {
                Values::F64(t.to_vec()?)
            } else {
                Values::F32(t.to_vec()?)
            })
        };
        let mut slots = self.state.iter();
        let first = match a {
            true => slots.next().map(read).transpose()?,
            false => None,
        };
        let second = match b {
            true => slots.next().map(read).transpose()?,
            false => None,
        };
        Ok(SlotState {
            first,
            second,
            steps: self.steps,
        })
    }
}

/// An update rule's state for one variable (or one shard of it), as checkpoints keep it beside
/// the variable: each slot the rule uses, as long as the variable, in the rule's arithmetic
/// (f32 for f32, f16 and bf16 variables; f64 for f64 ones), and Adam's step count. A rule
/// that has not stepped the variable yet has zeros, as it starts from.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotState {
    /// SGD's momentum, or Adam's first moment (`m`); `None` for plain SGD.
    pub first: Option<Values>,
    /// Adam's second moment (`v`); `None` for SGD.
    pub second: Option<Values>,
    /// Adam's steps taken (`t`); 0 for SGD.
    pub steps: u32,
}

/// Whether a variable of `dtype` steps in f64 (else in f32).
pub(crate) fn steps_wide(dtype: DType) -> bool {
    dtype == DType::F64
}

impl AnySlots {
    /// The state `rule` keeps here for a variable of `len` elements (`wide`: f64 arithmetic).
    pub(crate) fn export(&self, rule: &Rule, len: usize, wide: bool) -> SlotState {
        fn part<C: Copy + Default>(v: &[C], used: bool, len: usize) -> Option<Vec<C>> {
            used.then(|| match v.len() == len {
                true => v.to_vec(),
                false => vec![C::default(); len],
            })
        }
        let (a, b) = rule.slots_used();
        let (first, second, steps) = if wide {
            let s = &self.f64;
            let f = |v, u| part(v, u, len).map(Values::F64);
            (f(&s.a, a), f(&s.b, b), s.steps)
        } else {
            let s = &self.f32;
            let f = |v, u| part(v, u, len).map(Values::F32);
            (f(&s.a, a), f(&s.b, b), s.steps)
        };
        SlotState {
            first,
            second,
            steps: steps.max(0) as u32,
        }
    }

    /// Take `state` as what `rule` keeps here for a variable of `len` elements (`wide`: f64
    /// arithmetic); a state that `rule` could not have kept for it is an error saying why, and
    /// leaves these slots as they were.
    pub(crate) fn import(
        &mut self,
        rule: &Rule,
        len: usize,
        wide: bool,
        state: &SlotState,
    ) -> std::result::Result<(), String> {
        let (a, b) = rule.slots_used();
        let arith = if wide { DType::F64 } else { DType::F32 };
        for (used, got, which) in [(a, &state.first, "first"), (b, &state.second, "second")] {
            match got {
                None if used => return Err(format!("the rule keeps a {which} slot; none given")),
                Some(_) if !used => {
                    return Err(format!("the rule keeps no {which} slot; one given"))
                }
                Some(v) if v.dtype() != arith || v.len() != len => {
                    return Err(format!(
                        "the {which} slot is {} {}, not {len} {arith} (the variable's)",
                        v.len(),
                        v.dtype()
                    ))
                }
                _ => {}
            }
        }
        let steps = i32::try_from(state.steps)
            .map_err(|_| format!("{} steps taken: more than a rule counts", state.steps))?;
        // Only Adam counts its steps.
        let steps = if b { steps } else { 0 };
        fn take<C: Clone>(v: &Option<Values>, get: fn(&Values) -> Option<&[C]>) -> Vec<C> {
            v.as_ref()
                .and_then(get)
                .map_or_else(Vec::new, <[C]>::to_vec)
        }
        if wide {
            self.f64 = Slots {
                a: take(&state.first, Values::get::<f64>),
                b: take(&state.second, Values::get::<f64>),
                steps,
            };
        } else {
            self.f32 = Slots {
                a: take(&state.first, Values::get::<f32>),
                b: take(&state.second, Values::get::<f32>),
                steps,
            };
        }
        Ok(())
    }
}

impl SlotState {
    /// Add this state, as `rule` keeps it, to `ckpt` under `prefix`: `{prefix}/momentum`, or
    /// Adam's `{prefix}/m`, `{prefix}/v` and `{prefix}/t` (plain SGD adds nothing).
    pub fn save(&self, rule: &Rule, ckpt: &mut Checkpoint, prefix: &str) -> Result<()> {
        let [a, b, t] = rule.slot_names();
        for (name, v) in [(a, &self.first), (b, &self.second)] {
            let (Some(name), Some(v)) = (name, v) else {
                continue;
            };
            let name = format!("{prefix}/{name}");
            match v {
                Values::F64(x) => ckpt.insert(&name, &Tensor::vector(x.clone()))?,
                Values::F32(x) => ckpt.insert(&name, &Tensor::vector(x.clone()))?,
                other => {
                    return Err(Error::config(format!(
                        "{name}: slots are f32 or f64, not {}",
                        other.dtype()
                    )))
                }
            }
        }
        if let Some(t) = t {
            let steps = Tensor::new(vec![i64::from(self.steps)], Vec::new())?;
            ckpt.insert(&format!("{prefix}/{t}"), &steps)?;
        }
        Ok(())
    }

    /// The state `rule` keeps for a variable of `len` elements of `dtype`, from `ckpt` under
    /// `prefix` (as [`SlotState::save`] wrote it); a slot that is missing, or of another
    /// length or type, is an error naming it.
    pub fn load(
        rule: &Rule,
        ckpt: &Checkpoint,
        prefix: &str,
        len: usize,
        dtype: DType,
    ) -> Result<SlotState> {
        let [a, b, t] = rule.slot_names();
        let wide = steps_wide(dtype);
        let slot = |name: Option<&str>| -> Result<Option<Values>> {
            let Some(name) = name else {
                return Ok(None);
            };
            let name = format!("{prefix}/{name}");
            let v: Values = if wide {
                ckpt.get::<f64>(&name)?.data.into()
            } else {
                ckpt.get::<f32>(&name)?.data.into()
            };
            if v.len() != len {
                return Err(Error::config(format!(
                    "checkpoint {name}: {} elements, for a variable of {len}",
                    v.len()
                )));
            }
            Ok(Some(v))
        };
        let steps = match t {
            None => 0,
            Some(t) => {
                let name = format!("{prefix}/{t}");
                let v = ckpt.get::<i64>(&name)?.data;
                match v[..] {
                    [s] => u32::try_from(s).map_err(|_| {
                        Error::config(format!("checkpoint {name}: {s} is not a step count"))
                    })?,
                    _ => {
                        return Err(Error::config(format!(
                            "checkpoint {name}: {} values, not one step count",
                            v.len()
                        )))
                    }
                }
            }
        };
        Ok(SlotState {
            first: slot(a)?,
            second: slot(b)?,
            steps,
        })
    }
}

impl Rule {
    /// Its learning rate.
    pub fn learning_rate(&self) -> f32 {
        match *self {
            Rule::Sgd { learning_rate, .. } | Rule::Adam { learning_rate, .. } => learning_rate,
        }
    }

    /// The same rule with learning rate `lr`.
    pub fn with_learning_rate(mut self, lr: f32) -> Rule {
        match &mut self {
            Rule::Sgd { learning_rate, .. } | Rule::Adam { learning_rate, .. } => {
                *learning_rate = lr
            }
        }
        self
    }

    /// The slots the rule keeps, and no more: none for plain SGD, one for momentum, two for
    /// Adam.
    pub(crate) fn slots_used(&self) -> (bool, bool) {
        match *self {
            Rule::Sgd { momentum, .. } => (momentum != 0.0, false),
            Rule::Adam { .. } => (true, true),
        }
    }

    /// The rule as a program on an XLA device steps by (its learning rate is the program's
    /// argument).
    #[cfg(feature = "xla")]
    fn device_step(&self) -> crate::device::pjrt::program::Step {
        use crate::device::pjrt::program::Step;
        match *self {
            Rule::Sgd {
                momentum, nesterov, ..
            } => Step::Sgd {
                momentum: momentum.to_bits(),
                nesterov,
            },
            Rule::Adam {
                beta_1,
                beta_2,
                epsilon,
                ..
            } => Step::Adam {
                beta_1: beta_1.to_bits(),
                beta_2: beta_2.to_bits(),
                epsilon: epsilon.to_bits(),
            },
        }
    }

    /// Adam's powers `[b1^t, b2^t]` after `steps` steps, in the rule's arithmetic (`wide`:
    /// f64), as its step computes them; `None` for SGD.
    #[cfg_attr(not(feature = "xla"), allow(dead_code))]
    fn powers(&self, steps: u32, wide: bool) -> Option<Values> {
        let Rule::Adam { beta_1, beta_2, .. } = *self else {
            return None;
        };
        let t = i32::try_from(steps).unwrap_or(i32::MAX);
        Some(if wide {
            Values::F64(vec![f64::of(beta_1).powi(t), f64::of(beta_2).powi(t)])
        } else {
            Values::F32(vec![beta_1.powi(t), beta_2.powi(t)])
        })
    }

    /// The names its state takes in a checkpoint: the first slot's, the second's, the step
    /// count's (Keras's names: `momentum`; Adam's `m`, `v` and `t`).
    fn slot_names(&self) -> [Option<&'static str>; 3] {
        match *self {
            Rule::Sgd { momentum, .. } if momentum != 0.0 => [Some("momentum"), None, None],
            Rule::Sgd { .. } => [None; 3],
            Rule::Adam { .. } => [Some("m"), Some("v"), Some("t")],
        }
    }

    /// Step `w` by the gradient `g` (as long as `w`), keeping the rule's state in `slots`.
    pub(crate) fn step<S: Param>(&self, slots: &mut AnySlots, w: &mut [S], g: &[S]) {
        let s = S::slots(slots);
        let (a, b) = self.slots_used();
        if a && s.a.len() != w.len() {
            s.a = vec![S::C::default(); w.len()];
        }
        if b && s.b.len() != w.len() {
            s.b = vec![S::C::default(); w.len()];
        }
        if let Rule::Adam { .. } = self {
            s.steps = s.steps.saturating_add(1);
        }
        let of = S::C::of;
        // The rule's arithmetic over `w` and `g` in its type, a stretch at a time from `at`.
        let mut kernel = |at: usize, w: &mut [S::C], g: &[S::C]| match *self {
            Rule::Sgd {
                learning_rate,
                momentum,
                nesterov,
            } => {
                let (lr, mu) = (of(learning_rate), of(momentum));
                if momentum == 0.0 {
                    for (w, &g) in w.iter_mut().zip(g) {
                        *w = *w - lr * g;
                    }
                    return;
                }
                for ((w, &g), v) in w.iter_mut().zip(g).zip(&mut s.a[at..]) {
                    *v = mu * *v - lr * g;
                    *w = *w + if nesterov { mu * *v - lr * g } else { *v };
                }
            }
            Rule::Adam {
                learning_rate,
                beta_1,
                beta_2,
                epsilon,
            } => {
                let t = s.steps;
                let (b1, b2, eps, one) = (of(beta_1), of(beta_2), of(epsilon), of(1.0));
                let lr_t = of(learning_rate) * (one - b2.powi(t)).sqrt() / (one - b1.powi(t));
                let (ms, vs) = (&mut s.a[at..], &mut s.b[at..]);
                for (((w, &g), m), v) in w.iter_mut().zip(g).zip(ms).zip(vs) {
                    *m = b1 * *m + (one - b1) * g;
                    *v = b2 * *v + (one - b2) * g * g;
                    *w = *w - lr_t * *m / (v.sqrt() + eps);
                }
            }
        };
        S::in_compute(w, g, &mut kernel);
    }

    /// Why the rule cannot step a variable, if it cannot: a learning rate that is negative or not
    /// finite (0 is one, as a warm-up's first step may take it), a momentum
    /// outside [0, 1], a beta outside [0, 1), an epsilon that is not positive (0 makes 0/0 of a
    /// gradient that stays 0).
    pub fn check(&self) -> std::result::Result<(), String> {
        rate_ok(self.learning_rate())?;
        match *self {
            Rule::Sgd { momentum, .. } if !(0.0..=1.0).contains(&momentum) => {
                Err(format!("momentum {momentum} must be in [0, 1]"))
            }
            Rule::Adam { beta_1, .. } if !(0.0..1.0).contains(&beta_1) => {
                Err(format!("beta_1 {beta_1} must be in [0, 1)"))
            }
            Rule::Adam { beta_2, .. } if !(0.0..1.0).contains(&beta_2) => {
                Err(format!("beta_2 {beta_2} must be in [0, 1)"))
            }
            Rule::Adam { epsilon, .. } if !(epsilon > 0.0 && epsilon.is_finite()) => {
                Err(format!("epsilon {epsilon} must be positive and finite"))
            }
            _ => Ok(()),
        }
    }
}

/// Why `lr` cannot be a learning rate, if it cannot: negative, or not finite (0 is one: a
/// warm-up's first step takes it).
fn rate_ok(lr: f32) -> std::result::Result<(), String> {
    if lr >= 0.0 && lr.is_finite() {
        Ok(())
    } else {
        Err(format!(
            "learning rate {lr} must be finite and not negative"
        ))
    }
}

/// Where an [`Optimizer`]'s learning rate comes from.
enum Rate {
    /// One rate for every step.
    Fixed(f32),
    /// A rate for each step, from the steps taken before it.
    Schedule(std::sync::Arc<dyn Fn(u64) -> f32 + Send + Sync>),
}

/// A strategy-aware optimizer for float [`MirroredVariable`]s (f32, f64, f16, bf16: see
/// [`Param`]). Inside [`Strategy::run`],
/// [`Optimizer::apply_gradients`] sums each gradient across every replica in sync (one fused
/// all-reduce: compute the loss with [`compute_average_loss`] so the sum is the global batch's
/// gradient), then steps the replica's copy of each variable; every copy keeps its own slots,
/// updated alike, so the copies stay identical. Its learning rate can change between steps
/// ([`Optimizer::set_learning_rate`]) or follow a schedule of the step count
/// ([`Optimizer::set_schedule`], as Keras's `LearningRateSchedule`), on the devices too.
pub struct Optimizer {
    /// The rule; its learning rate is the one it was made with ([`Optimizer::learning_rate`]
    /// gives the one the next step takes).
    rule: Rule,
    /// The learning rate of each step from now on.
    rate: Mutex<Rate>,
    /// Per variable and copy; each its own lock, so the replicas step their copies at once.
    slots: Mutex<HashMap<(u64, usize), SharedSlots>>,
    /// The same for [`DeviceVariable`]s, whose slots live beside their copies.
    device_slots: Mutex<HashMap<(u64, usize), SharedDeviceSlots>>,
    iterations: AtomicU64,
    /// Tells the optimizers apart in a run's count of steps ([`ReplicaContext::step_number`]).
    id: u64,
}

impl Optimizer {
    /// An optimizer with `rule`; a learning rate that is negative or not finite, or a hyper-parameter
    /// that is not finite, is an error.
    pub fn new(rule: Rule) -> Result<Optimizer> {
        rule.check()
            .map_err(|why| Error::config(format!("optimizer: {why}")))?;
        Ok(Optimizer {
            rule,
            rate: Mutex::new(Rate::Fixed(rule.learning_rate())),
            slots: Mutex::new(HashMap::new()),
            device_slots: Mutex::new(HashMap::new()),
            iterations: AtomicU64::new(0),
            id: {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
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

    /// The learning rate the next step takes: the one last set, or the schedule's at
    /// [`Optimizer::iterations`].
    pub fn learning_rate(&self) -> f32 {
        self.rate_at(self.iterations())
    }

    /// The learning rate of step `step` (counted from 0).
    fn rate_at(&self, step: u64) -> f32 {
        // The schedule is called unlocked: it may read the optimizer.
        let schedule = match &*self.rate.lock() {
            Rate::Fixed(lr) => return *lr,
            Rate::Schedule(f) => f.clone(),
        };
        schedule(step)
    }

    /// Take `learning_rate` at every step from the next on (in place of a schedule), as
    /// setting Keras's `optimizer.learning_rate` does: on every kind of variable, a
    /// [`DeviceVariable`]'s steps on its device too. Negative or not finite: an error, and the
    /// rate stays as it was. Set it alike on every worker, between steps.
    pub fn set_learning_rate(&self, learning_rate: f32) -> Result<()> {
        rate_ok(learning_rate).map_err(|why| Error::config(format!("optimizer: {why}")))?;
        *self.rate.lock() = Rate::Fixed(learning_rate);
        Ok(())
    }

    /// Take the learning rate of each step from `schedule`, called with the steps taken before
    /// it ([`Optimizer::iterations`], as Keras calls a `LearningRateSchedule`), on every
    /// replica and worker alike: it must depend on nothing else. A step whose rate is not
    /// finite and not negative is an error of that step, before anything is summed, and leaves every
    /// variable as it was.
    pub fn set_schedule(&self, schedule: impl Fn(u64) -> f32 + Send + Sync + 'static) {
        *self.rate.lock() = Rate::Schedule(std::sync::Arc::new(schedule));
    }

    /// The rule of the step replica `ctx` takes: the optimizer's with the step's learning rate,
    /// the same on every replica of the step (see [`ReplicaContext::step_number`]).
    fn rule_now(&self, ctx: &ReplicaContext<'_>, what: &str) -> Result<Rule> {
        let step = ctx.step_number(self.id, self.iterations());
        let lr = self.rate_at(step);
        rate_ok(lr)
            .map_err(|why| Error::config(format!("{what}: step {step} of the optimizer: {why}")))?;
        Ok(self.rule.with_learning_rate(lr))
    }

    /// Sum `grads_and_vars`' gradients across every replica in sync and step the replica's
    /// copy of each variable by them. Collective: every replica calls it with the same
    /// variables in the same order. A gradient whose length differs from its variable's is an
    /// error before anything is summed.
    pub fn apply_gradients<T: Param>(
        &self,
        ctx: &ReplicaContext<'_>,
        grads_and_vars: &[(&[T], &MirroredVariable<T>)],
    ) -> Result<()> {
        let rule = self.rule_now(ctx, "apply_gradients");
        let checked = grads_and_vars
            .iter()
            .enumerate()
            .try_for_each(|(k, (g, v))| {
                v.copy_in(ctx)?;
                if g.len() != v.len() {
                    return Err(Error::config(format!(
                        "apply_gradients: gradient {k} holds {} elements, its variable {}",
                        g.len(),
                        v.len()
                    )));
                }
                Ok(())
            });
        // The other workers' gradients are summed with this one's next.
        let rule = ctx.before_workers(Collective::AllReduce, checked.and(rule))?;
        let mut sums: Vec<Vec<T>> = grads_and_vars.iter().map(|(g, _)| g.to_vec()).collect();
        let mut bufs: Vec<&mut [T]> = sums.iter_mut().map(|g| g.as_mut_slice()).collect();
        ctx.all_reduce_batch(ReduceOp::Sum, &mut bufs)?;
        let me = ctx.local_replica_id();
        for (g, (_, var)) in sums.iter().zip(grads_and_vars) {
            let slots = self.slots.lock().entry((var.id(), me)).or_default().clone();
            var.update_copy(me, |w| rule.step(&mut slots.lock(), w, g));
        }
        if me == 0 {
            // Once per step on every worker (its first local replica).
            self.iterations.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// [`Optimizer::apply_gradients`] for [`CentralVariable`]s (CentralStorageStrategy), in
    /// the cross-replica context: each variable's gradients, one per local replica, are summed
    /// across every replica in sync, and the one copy is stepped once by the rule, its slots
    /// kept beside it. A gradient count other than the local replicas', or a gradient whose
    /// length differs from its variable's, is an error before anything is summed, and leaves
    /// every variable as it was.
    pub fn apply_central_gradients<T: Param>(
        &self,
        strategy: &Strategy,
        grads_and_vars: &[(&PerReplica<Vec<T>>, &CentralVariable<T>)],
    ) -> Result<()> {
        let step = self.iterations();
        let lr = self.rate_at(step);
        rate_ok(lr).map_err(|why| {
            Error::config(format!(
                "apply_central_gradients: step {step} of the optimizer: {why}"
            ))
        })?;
        let rule = self.rule.with_learning_rate(lr);
        let n = strategy.num_local_replicas();
        for (k, (g, v)) in grads_and_vars.iter().enumerate() {
            if g.0.len() != n {
                return Err(Error::config(format!(
                    "apply_central_gradients: gradient {k} has {} per-replica values, the \
                     strategy {n} local replicas",
                    g.0.len()
                )));
            }
            if let Some((r, x)) = g.0.iter().enumerate().find(|(_, x)| x.len() != v.len()) {
                return Err(Error::config(format!(
                    "apply_central_gradients: gradient {k} of replica {r} holds {} elements, \
                     its variable {}",
                    x.len(),
                    v.len()
                )));
            }
        }
        let mut sums = Vec::with_capacity(grads_and_vars.len());
        for (g, v) in grads_and_vars {
            let per = PerReplica(
                g.0.iter()
                    .map(|x| Tensor::new(x.clone(), vec![v.len()]))
                    .collect::<Result<Vec<_>>>()?,
            );
            sums.push(strategy.reduce(ReduceOp::Sum, &per, None)?.data);
        }
        for (sum, (_, var)) in sums.iter().zip(grads_and_vars) {
            let slots = self.slots.lock().entry((var.id(), 0)).or_default().clone();
            var.update_with(|w| rule.step(&mut slots.lock(), w, sum));
        }
        self.iterations.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// [`Optimizer::apply_gradients`] for [`DeviceVariable`]s, on the replicas' devices: each
    /// gradient (a tensor on the replica's device, of its variable's dtype and length) is summed
    /// in place across every replica in sync, where it lies, then the replica's copy is stepped
    /// there, its slots beside it: on XLA devices one compiled program per variable, nothing
    /// copied through host memory. On one worker's XLA devices (no cross-device op of the
    /// caller's) that one program is the sum and every replica's step together, one launch for
    /// all the devices; across workers, the sum (through the workers' all-reduce) and then a
    /// program per replica. Where the plugin refuses the fused program under the `Auto` route,
    /// the sum and the steps run apart on the devices; where it refuses those too, or the
    /// client's route is host-staged, through host memory, to the same rule. Copies in host
    /// memory (CPU replicas) step as a [`MirroredVariable`]'s do. Collective: every replica calls it with the same variables in the same order. Each
    /// gradient holds the sum afterwards.
    pub fn apply_device_gradients<T: Param>(
        &self,
        ctx: &ReplicaContext<'_>,
        grads_and_vars: &mut [(&mut DeviceTensor, &DeviceVariable<T>)],
    ) -> Result<()> {
        let rule = self.rule_now(ctx, "apply_device_gradients");
        let checked = grads_and_vars
            .iter()
            .enumerate()
            .try_for_each(|(k, (g, v))| {
                v.copy_in(ctx)?;
                if (g.dtype(), g.len()) != (T::DTYPE, v.len()) {
                    return Err(Error::config(format!(
                        "apply_device_gradients: gradient {k} is {g:?}, its variable {} x {}",
                        T::DTYPE,
                        v.len()
                    )));
                }
                Ok(())
            });
        let rule = ctx.before_workers(Collective::AllReduce, checked.and(rule))?;
        let me = ctx.local_replica_id();
        // On one worker's XLA devices each variable's sum and step are one program.
        #[cfg(feature = "xla")]
        let fused = fuses_steps::<T>(ctx, &rule, grads_and_vars)?;
        #[cfg(not(feature = "xla"))]
        let fused = false;
        if !fused {
            for (g, _) in grads_and_vars.iter_mut() {
                ctx.all_reduce_tensor(ReduceOp::Sum, g)?;
            }
        }
        let slots_of = |var: &DeviceVariable<T>| {
            self.device_slots
                .lock()
                .entry((var.id(), me))
                .or_default()
                .clone()
        };
        #[cfg(feature = "xla")]
        if fused {
            let kept: Vec<SharedDeviceSlots> =
                grads_and_vars.iter().map(|(_, v)| slots_of(v)).collect();
            let mut slots: Vec<_> = kept.iter().map(|s| s.lock()).collect();
            let mut copies = Vec::with_capacity(grads_and_vars.len());
            for (_, var) in grads_and_vars.iter() {
                copies.push(var.copy(me)?);
            }
            let mut grads: Vec<&mut DeviceTensor> =
                grads_and_vars.iter_mut().map(|(g, _)| &mut **g).collect();
            xla_fused_steps::<T>(ctx, &rule, &mut grads, &mut copies, &mut slots)?;
        }
        for (g, var) in grads_and_vars.iter().filter(|_| !fused) {
            let slots = slots_of(var);
            let mut copy = var.copy(me)?;
            step_copy::<T>(&rule, &mut copy, g, &mut slots.lock())?;
        }
        if me == 0 {
            self.iterations.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Add this optimizer's state to `ckpt` under `name`, as TensorFlow's checkpoints keep an
    /// optimizer beside the model: `{name}/iterations`, and each variable's slots under
    /// `{name}/{variable}/` ([`SlotState::save`]), the variables named as the caller names them
    /// in the checkpoint. Call it outside [`Strategy::run`]; for variables of several dtypes,
    /// once per dtype. [`Optimizer::restore`] takes it back.
    pub fn save<T: Param>(
        &self,
        ckpt: &mut Checkpoint,
        name: &str,
        variables: &[(&str, &MirroredVariable<T>)],
    ) -> Result<()> {
        let held: Vec<_> = variables
            .iter()
            .map(|(n, v)| (*n, v.id(), v.len()))
            .collect();
        self.save_host(ckpt, name, T::DTYPE, &held)
    }

    /// [`Optimizer::save`] for [`CentralVariable`]s, in the same names and format.
    pub fn save_central<T: Param>(
        &self,
        ckpt: &mut Checkpoint,
        name: &str,
        variables: &[(&str, &CentralVariable<T>)],
    ) -> Result<()> {
        let held: Vec<_> = variables
            .iter()
            .map(|(n, v)| (*n, v.id(), v.len()))
            .collect();
        self.save_host(ckpt, name, T::DTYPE, &held)
    }

    /// The slots of variables in host memory, each `(name, id, length)`, under `name`: a
    /// variable's copies have identical slots, so its first copy's stand for all.
    fn save_host(
        &self,
        ckpt: &mut Checkpoint,
        name: &str,
        dtype: DType,
        variables: &[(&str, u64, usize)],
    ) -> Result<()> {
        let wide = steps_wide(dtype);
        let states: Vec<(&str, SlotState)> = variables
            .iter()
            .map(|&(vname, id, len)| {
                let kept = self.slots.lock().get(&(id, 0)).cloned();
                let state = match kept {
                    Some(s) => s.lock().export(&self.rule, len, wide),
                    None => AnySlots::default().export(&self.rule, len, wide),
                };
                (vname, state)
            })
            .collect();
        self.save_states(ckpt, name, &states)
    }

    /// [`Optimizer::save`] for [`DeviceVariable`]s: their slots, copied from the first copy's
    /// device, in the same names and format (a checkpoint of either kind restores into the
    /// other).
    pub fn save_device<T: Param>(
        &self,
        ckpt: &mut Checkpoint,
        name: &str,
        variables: &[(&str, &DeviceVariable<T>)],
    ) -> Result<()> {
        let wide = steps_wide(T::DTYPE);
        let mut states = Vec::with_capacity(variables.len());
        for (vname, var) in variables {
            let kept = self.device_slots.lock().get(&(var.id(), 0)).cloned();
            let state = match kept {
                Some(s) => s.lock().export(&self.rule, var.len(), wide)?,
                None => AnySlots::default().export(&self.rule, var.len(), wide),
            };
            states.push((*vname, state));
        }
        self.save_states(ckpt, name, &states)
    }

    /// The iteration count and each variable's `states`, under `name`.
    fn save_states(
        &self,
        ckpt: &mut Checkpoint,
        name: &str,
        states: &[(&str, SlotState)],
    ) -> Result<()> {
        let iterations = format!("{name}/iterations");
        if !ckpt.names().any(|n| n == iterations) {
            let it = i64::try_from(self.iterations()).unwrap_or(i64::MAX);
            ckpt.insert(&iterations, &Tensor::new(vec![it], Vec::new())?)?;
        }
        for (vname, state) in states {
            state.save(&self.rule, ckpt, &format!("{name}/{vname}"))?;
        }
        Ok(())
    }

    /// Take back the state [`Optimizer::save`] added to `ckpt` under `name`: the iteration
    /// count and, for every copy of each variable, its slots. A checkpoint with no state of
    /// this optimizer at all (saved without it) leaves the optimizer as it is, with a warning,
    /// as TensorFlow's restore and tutti's Python `Checkpoint` do. Otherwise everything is
    /// checked before anything is set: a slot missing, or of another length or type (an
    /// optimizer of another rule saved it, say), is an error naming it. Call it outside
    /// [`Strategy::run`], on every worker.
    pub fn restore<T: Param>(
        &self,
        ckpt: &Checkpoint,
        name: &str,
        variables: &[(&str, &MirroredVariable<T>)],
    ) -> Result<()> {
        let held: Vec<_> = variables
            .iter()
            .map(|(n, v)| (*n, v.id(), v.len(), v.copies()))
            .collect();
        self.restore_host(ckpt, name, T::DTYPE, &held)
    }

    /// [`Optimizer::restore`] for [`CentralVariable`]s.
    pub fn restore_central<T: Param>(
        &self,
        ckpt: &Checkpoint,
        name: &str,
        variables: &[(&str, &CentralVariable<T>)],
    ) -> Result<()> {
        let held: Vec<_> = variables
            .iter()
            .map(|(n, v)| (*n, v.id(), v.len(), 1))
            .collect();
        self.restore_host(ckpt, name, T::DTYPE, &held)
    }

    /// Restore the slots of variables in host memory, each `(name, id, length, copies)`.
    fn restore_host(
        &self,
        ckpt: &Checkpoint,
        name: &str,
        dtype: DType,
        variables: &[(&str, u64, usize, usize)],
    ) -> Result<()> {
        let lens: Vec<(&str, usize)> = variables.iter().map(|&(n, _, len, _)| (n, len)).collect();
        let Some((it, taken)) = self.load_states(ckpt, name, &lens, dtype)? else {
            return Ok(());
        };
        let mut kept = self.slots.lock();
        for (&(_, id, _, copies), slots) in variables.iter().zip(taken) {
            for copy in 0..copies {
                kept.insert((id, copy), std::sync::Arc::new(Mutex::new(slots.clone())));
            }
        }
        self.iterations.store(it, Ordering::Relaxed);
        Ok(())
    }

    /// [`Optimizer::restore`] for [`DeviceVariable`]s: each copy's slots go to its device at
    /// its next step.
    pub fn restore_device<T: Param>(
        &self,
        ckpt: &Checkpoint,
        name: &str,
        variables: &[(&str, &DeviceVariable<T>)],
    ) -> Result<()> {
        let lens: Vec<(&str, usize)> = variables.iter().map(|(n, v)| (*n, v.len())).collect();
        let Some((it, taken)) = self.load_states(ckpt, name, &lens, T::DTYPE)? else {
            return Ok(());
        };
        let mut kept = self.device_slots.lock();
        for ((_, var), slots) in variables.iter().zip(taken) {
            for copy in 0..var.copies() {
                let restored = DeviceSlots {
                    host: slots.clone(),
                    ..DeviceSlots::default()
                };
                kept.insert((var.id(), copy), std::sync::Arc::new(Mutex::new(restored)));
            }
        }
        self.iterations.store(it, Ordering::Relaxed);
        Ok(())
    }

    /// The iteration count and the slots of each of `variables` (name, length) of `dtype`
    /// under `name` in `ckpt`, all checked; `None` (with a warning) where it holds none of
    /// this optimizer's state.
    fn load_states(
        &self,
        ckpt: &Checkpoint,
        name: &str,
        variables: &[(&str, usize)],
        dtype: DType,
    ) -> Result<Option<(u64, Vec<AnySlots>)>> {
        let iterations = format!("{name}/iterations");
        let mine = format!("{name}/");
        if !ckpt.names().any(|n| n.starts_with(&mine)) {
            log::warn!(
                "checkpoint of step {}: no state of optimizer '{name}'; it starts afresh",
                ckpt.step()
            );
            return Ok(None);
        }
        let it = match ckpt.get::<i64>(&iterations)?.data[..] {
            [it] if it >= 0 => it as u64,
            _ => {
                return Err(Error::config(format!(
                    "checkpoint {iterations}: not one count of steps"
                )))
            }
        };
        let wide = steps_wide(dtype);
        let mut taken = Vec::with_capacity(variables.len());
        for &(vname, len) in variables {
            let prefix = format!("{name}/{vname}");
            let state = SlotState::load(&self.rule, ckpt, &prefix, len, dtype)?;
            let mut slots = AnySlots::default();
            slots
                .import(&self.rule, len, wide, &state)
                .map_err(|why| Error::config(format!("checkpoint {prefix}: {why}")))?;
            taken.push(slots);
        }
        Ok(Some((it, taken)))
    }
}

/// Step `copy` (a [`DeviceVariable`]'s copy) by the summed gradient `g` with `rule`, its
/// slots in `slots`: on its XLA device, or in host memory.
fn step_copy<T: Param>(
    rule: &Rule,
    copy: &mut DeviceTensor,
    g: &DeviceTensor,
    slots: &mut DeviceSlots,
) -> Result<()> {
    #[cfg(feature = "xla")]
    if copy.as_xla().is_some() {
        return xla_step::<T>(rule, copy, g, slots);
    }
    if g.kind() != copy.kind() {
        return Err(Error::config(format!(
            "apply_device_gradients: the gradient is {g:?}, the variable's copy {copy:?}"
        )));
    }
    let g: Vec<T> = g.to_vec()?;
    let Some(w) = copy.host_bytes_mut() else {
        return Err(Error::config(
            "apply_device_gradients: the variable's copy is not in host memory",
        ));
    };
    rule.step(&mut slots.host, bytemuck::cast_slice_mut::<u8, T>(w), &g);
    Ok(())
}

/// `state` (a rule's slots and step count) on `device` of `client`, as a step there takes it:
/// each slot the rule keeps, then Adam's powers.
#[cfg(feature = "xla")]
fn upload_state(
    rule: &Rule,
    client: &crate::device::pjrt::Client,
    device: usize,
    wide: bool,
    st: &SlotState,
) -> Result<Vec<DeviceTensor>> {
    let mut state = Vec::new();
    for v in [&st.first, &st.second].into_iter().flatten() {
        state.push(client.upload_bytes(v.as_bytes(), v.dtype(), device)?.into());
    }
    if let Some(p) = rule.powers(st.steps, wide) {
        state.push(client.upload_bytes(p.as_bytes(), p.dtype(), device)?.into());
    }
    Ok(state)
}

/// Ready `slots` for a step of the copy `w` on its XLA device: the rule's state made there at
/// the first step (zeros, or what a restore gave), and the learning rate there (uploaded where
/// it changed: [`DeviceSlots::rate`]).
#[cfg(feature = "xla")]
fn on_device<T: Param>(
    rule: &Rule,
    w: &crate::device::pjrt::XlaBuffer,
    slots: &mut DeviceSlots,
) -> Result<()> {
    let (client, device) = (w.client(), w.device());
    let (len, wide) = (w.len(), steps_wide(T::DTYPE));
    if slots.state.is_empty() {
        let init = slots.host.export(rule, len, wide);
        slots.state = upload_state(rule, &client, device, wide, &init)?;
        slots.steps = init.steps;
        slots.host = AnySlots::default();
    }
    let lr = rule.learning_rate();
    if !matches!(&slots.rate, Some((bits, _)) if *bits == lr.to_bits()) {
        let t = match wide {
            true => client.buffer_from_host(&[f64::from(lr)], device)?,
            false => client.buffer_from_host(&[lr], device)?,
        };
        slots.rate = Some((lr.to_bits(), t));
    }
    Ok(())
}

/// Whether replica `ctx` steps `grads_and_vars` each in one program with its gradients' sum
/// ([`xla_fused_steps`]): on XLA devices of one worker (several replicas, no cross-device op
/// of the caller's), with the client's route compiling programs and the plugin taking the
/// fused step's. Decided from what every replica of the step shares (the strategy, the
/// variables, the client's cached programs), never from one replica's own arguments, so that
/// every replica makes the same calls (a replica's gradient in host memory is then its
/// argument error, which the others hear as such).
#[cfg(feature = "xla")]
fn fuses_steps<T: Param>(
    ctx: &ReplicaContext<'_>,
    rule: &Rule,
    grads_and_vars: &[(&mut DeviceTensor, &DeviceVariable<T>)],
) -> Result<bool> {
    let s = ctx.strategy;
    let n = s.num_local_replicas();
    if n < 2
        || s.workers.is_some()
        || s.custom_ops(ReduceOp::Sum, T::DTYPE).is_some()
        || !matches!(s.engine, Some((crate::device::DeviceKind::Xla, _)))
    {
        return Ok(false);
    }
    // A variable given twice steps twice, one after the other: apart.
    let mut ids: Vec<u64> = grads_and_vars.iter().map(|(_, v)| v.id()).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Ok(false);
    }
    let step = rule.device_step();
    for (_, var) in grads_and_vars {
        // The replica's own copy (another's may be held by its step): every copy of the
        // variable is on one client.
        let Some(client) = var
            .copy(ctx.local_replica_id())?
            .as_xla()
            .map(|b| b.client())
        else {
            return Ok(false);
        };
        if client.route() == crate::xla::Route::HostStaged {
            return Ok(false);
        }
        let compiled = client
            .inner
            .group_step_program(step, T::DTYPE, var.len(), n)?;
        if !matches!(compiled, crate::device::pjrt::client::Compiled::Ready(_)) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Replica `ctx`'s `copies` stepped by their gradients `grads` summed across the replicas,
/// each variable in one program over every replica's device
/// ([`crate::device::pjrt::Client`]'s `run_group_step`): each gradient holds the sum
/// afterwards, each copy and its slots (beside it on its device) the step's. Everything the
/// steps need is made on the devices first (the slots at the first step, the learning rate),
/// so that a failure there leaves every variable as it was.
#[cfg(feature = "xla")]
fn xla_fused_steps<T: Param>(
    ctx: &ReplicaContext<'_>,
    rule: &Rule,
    grads: &mut [&mut DeviceTensor],
    copies: &mut [parking_lot::MutexGuard<'_, DeviceTensor>],
    slots: &mut [parking_lot::MutexGuard<'_, DeviceSlots>],
) -> Result<()> {
    for (copy, slots) in copies.iter().zip(slots.iter_mut()) {
        match copy.as_xla() {
            Some(w) => on_device::<T>(rule, w, slots)?,
            None => {
                return Err(Error::config(format!(
                    "apply_device_gradients: the variable's copy {:?} is not on an XLA device",
                    **copy
                )))
            }
        }
    }
    let step = rule.device_step();
    for ((g, copy), slots) in grads
        .iter_mut()
        .zip(copies.iter_mut())
        .zip(slots.iter_mut())
    {
        let DeviceSlots {
            state, rate, steps, ..
        } = &mut **slots;
        let Some((_, lr)) = rate.as_ref() else {
            return Err(Error::config(
                "apply_device_gradients: the learning rate is not on the device",
            ));
        };
        let mut args = crate::engine::pjrt::StepArgs {
            step,
            copy,
            lr,
            state,
            steps,
        };
        ctx.comm.step_tensor(g, &mut args)?;
    }
    Ok(())
}

/// [`step_copy`] on an XLA device: one program there ([`crate::device::pjrt::Client`]'s
/// `run_step`), the slots made there at the first step (zeros, or what a restore gave); where
/// the step is to run on the host instead, the copy, gradient and slots go there and back.
#[cfg(feature = "xla")]
fn xla_step<T: Param>(
    rule: &Rule,
    copy: &mut DeviceTensor,
    g: &DeviceTensor,
    slots: &mut DeviceSlots,
) -> Result<()> {
    let (Some(w), Some(gb)) = (copy.as_xla(), g.as_xla()) else {
        return Err(Error::config(format!(
            "apply_device_gradients: the gradient is {g:?}, the variable's copy {copy:?}: \
             place the gradient on the copy's device"
        )));
    };
    let (client, device) = (w.client(), w.device());
    let (len, wide) = (copy.len(), steps_wide(T::DTYPE));
    on_device::<T>(rule, w, slots)?;
    let step = rule.device_step();
    let Some((_, lr)) = slots.rate.as_ref() else {
        return Err(Error::config(
            "apply_device_gradients: the learning rate is not on the device",
        ));
    };
    let state: Vec<&crate::device::pjrt::XlaBuffer> = slots
        .state
        .iter()
        .filter_map(DeviceTensor::as_xla)
        .collect();
    if let Some((new_w, new_state)) = client.run_step(step, w, gb, lr, &state)? {
        copy.replace(new_w.into());
        slots.state = new_state.into_iter().map(DeviceTensor::from).collect();
        if step.powers() {
            slots.steps = slots.steps.saturating_add(1);
        }
        return Ok(());
    }
    // On the host, to the same rule.
    let (mut wv, gv) = (copy.to_vec::<T>()?, g.to_vec::<T>()?);
    let mut host = AnySlots::default();
    host.import(rule, len, wide, &slots.export(rule, len, wide)?)
        .map_err(Error::config)?;
    rule.step(&mut host, &mut wv, &gv);
    let after = host.export(rule, len, wide);
    // Everything on the device before any of it is kept: a failed upload leaves the copy and
    // its slots as they were.
    let (new_w, new_state) = (
        client.buffer_from_host(&wv, device)?,
        upload_state(rule, &client, device, wide, &after)?,
    );
    copy.replace(new_w.into());
    slots.state = new_state;
    slots.steps = after.steps;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// f16 and bf16 shards are stepped a stretch at a time: across stretch boundaries, every
    /// element as the rule stepped one at a time in f32 and rounded back would have it.
    #[test]
    fn half_precision_steps_match_the_element_wise_rule_across_stretches() {
        fn check<H: Param<C = f32>>() {
            let n = 2 * STRETCH + 77;
            let w0: Vec<H> = (0..n).map(|i| H::store((i as f32 * 0.37).sin())).collect();
            let g: Vec<H> = (0..n).map(|i| H::store((i as f32 * 0.11).cos())).collect();
            for rule in [
                Rule::Sgd {
                    learning_rate: 0.1,
                    momentum: 0.9,
                    nesterov: true,
                },
                Rule::Adam {
                    learning_rate: 0.01,
                    beta_1: 0.9,
                    beta_2: 0.999,
                    epsilon: 1e-7,
                },
            ] {
                let (mut w, mut slots) = (w0.clone(), AnySlots::default());
                // The reference: each element on its own in f32, rounded back every step.
                let (mut r, mut r_slots) = (w0.clone(), AnySlots::default());
                for _ in 0..3 {
                    rule.step(&mut slots, &mut w, &g);
                    let mut wf: Vec<f32> = r.iter().map(|x| x.load()).collect();
                    let gf: Vec<f32> = g.iter().map(|x| x.load()).collect();
                    rule.step(&mut r_slots, &mut wf, &gf);
                    r = wf.into_iter().map(H::store).collect();
                }
                assert!(w == r, "{rule:?} on {}", H::DTYPE);
            }
        }
        check::<half::f16>();
        check::<half::bf16>();
    }
}
