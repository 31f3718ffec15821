//! `strategy.scope()`: the strategy whose variables are made on this thread.
//!
//! TensorFlow's `with strategy.scope(): v = tf.Variable(...)` makes `v` the strategy's kind of
//! variable (mirrored, stored once, sharded over the parameter servers) without the code that
//! makes it knowing which strategy runs it: a model's constructor written once runs under every
//! strategy. Here the scope is a guard ([`Strategy::scope`], [`Coordinator::scope`] for a
//! ParameterServerStrategy's chief) that sets this thread's current strategy until it is
//! dropped, and [`Variable::new`] makes its variable with the current strategy, or, outside any
//! scope, with the default strategy (one replica, one copy). As in TensorFlow, a second
//! strategy's scope cannot be entered inside a first one's; the same strategy's scope may nest.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use super::ps::{Coordinator, Values, VariableId};
use super::{Aggregation, CentralVariable, MirroredVariable, PerReplica, ReplicaContext};
use super::{Strategy, StrategyKind};
use crate::dtype::Element;
use crate::error::{Error, Result};

/// Whose variables a scope makes: a strategy's, or a parameter-server job's coordinator's.
#[derive(Clone)]
enum Owner {
    Strategy(Arc<Strategy>),
    Coordinator(Arc<Coordinator>),
}

impl Owner {
    fn same(&self, other: &Owner) -> bool {
        match (self, other) {
            (Owner::Strategy(a), Owner::Strategy(b)) => Arc::ptr_eq(a, b),
            (Owner::Coordinator(a), Owner::Coordinator(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Owner::Strategy(s) => s.kind().name(),
            Owner::Coordinator(_) => "ParameterServerStrategy",
        }
    }
}

thread_local! {
    /// The scopes entered on this thread, innermost last (one strategy, entered as many times
    /// as its scopes nest).
    static SCOPES: RefCell<Vec<Owner>> = const { RefCell::new(Vec::new()) };
}

fn enter(owner: Owner) -> Result<()> {
    // `try_with`: a thread's storage may be gone (a scope begun from a destructor at exit).
    let entered = SCOPES.try_with(|s| {
        let mut s = s.borrow_mut();
        if let Some(top) = s.last() {
            if !top.same(&owner) {
                return Err(Error::config(format!(
                    "scope: this thread is inside a {}'s scope; a {}'s cannot be entered in it \
                     (mixing strategies, as TensorFlow refuses)",
                    top.name(),
                    owner.name()
                )));
            }
        }
        s.push(owner);
        Ok(())
    });
    entered.unwrap_or_else(|_| {
        Err(Error::config(
            "scope: this thread is exiting (its scopes are gone); enter a scope before",
        ))
    })
}

fn exit(owner: &Owner) -> Result<()> {
    SCOPES
        .try_with(|s| {
            let mut s = s.borrow_mut();
            match s.last() {
                Some(top) if top.same(owner) => {
                    s.pop();
                    Ok(())
                }
                _ => Err(Error::config(
                    "scope: this strategy's scope is not the one this thread is in (each scope \
                     is left on the thread that entered it)",
                )),
            }
        })
        // The thread is exiting and its scopes are gone with it: nothing left to leave.
        .unwrap_or(Ok(()))
}

/// Make `strategy` this thread's current strategy until [`exit_scope`] (the guard-free form of
/// [`Strategy::scope`], for callers that cannot hold a guard: the C ABI's
/// `tutti_strategy_scope_begin`). Inside another strategy's scope it is an error.
pub fn enter_scope(strategy: &Arc<Strategy>) -> Result<()> {
    enter(Owner::Strategy(strategy.clone()))
}

/// Leave `strategy`'s innermost scope on this thread (see [`enter_scope`]); an error where it
/// is not this thread's current strategy.
pub fn exit_scope(strategy: &Arc<Strategy>) -> Result<()> {
    exit(&Owner::Strategy(strategy.clone()))
}

/// [`enter_scope`] for a ParameterServerStrategy's coordinator (the guard-free form of
/// [`Coordinator::scope`]): until [`exit_coordinator_scope`], variables made on this thread
/// live on the job's parameter servers.
pub fn enter_coordinator_scope(coordinator: &Arc<Coordinator>) -> Result<()> {
    enter(Owner::Coordinator(coordinator.clone()))
}

/// Leave `coordinator`'s innermost scope on this thread (see [`enter_coordinator_scope`]).
pub fn exit_coordinator_scope(coordinator: &Arc<Coordinator>) -> Result<()> {
    exit(&Owner::Coordinator(coordinator.clone()))
}

/// The strategy of this thread's innermost scope (TensorFlow's `tf.distribute.get_strategy()`
/// inside a scope); `None` outside any, where variables are the default strategy's, and inside
/// a coordinator's ([`current_coordinator`]).
pub fn current_strategy() -> Option<Arc<Strategy>> {
    match innermost() {
        Some(Owner::Strategy(st)) => Some(st),
        _ => None,
    }
}

/// This thread's innermost scope (none once the thread's storage is gone, at its exit).
fn innermost() -> Option<Owner> {
    SCOPES
        .try_with(|s| s.borrow().last().cloned())
        .ok()
        .flatten()
}

/// The coordinator of this thread's innermost scope, where it is a ParameterServerStrategy's.
pub fn current_coordinator() -> Option<Arc<Coordinator>> {
    match innermost() {
        Some(Owner::Coordinator(c)) => Some(c),
        _ => None,
    }
}

/// A strategy's scope on this thread ([`Strategy::scope`], [`Coordinator::scope`]): left when
/// dropped.
#[must_use = "the scope ends when this guard is dropped"]
pub struct Scope {
    owner: Owner,
    /// A scope is left on the thread that entered it.
    _not_send: PhantomData<*const ()>,
}

impl Scope {
    fn entered(owner: Owner) -> Result<Scope> {
        enter(owner.clone())?;
        Ok(Scope {
            owner,
            _not_send: PhantomData,
        })
    }

    /// The scope's strategy (`None` in a coordinator's scope).
    pub fn strategy(&self) -> Option<&Arc<Strategy>> {
        match &self.owner {
            Owner::Strategy(s) => Some(s),
            Owner::Coordinator(_) => None,
        }
    }

    /// The scope's coordinator (`None` in a strategy's scope).
    pub fn coordinator(&self) -> Option<&Arc<Coordinator>> {
        match &self.owner {
            Owner::Coordinator(c) => Some(c),
            Owner::Strategy(_) => None,
        }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        // Entered on this thread by this guard, which cannot move to another: always the
        // innermost (a guard dropped out of order leaves the innermost scope of the same
        // strategy, which is equivalent). Nothing to report from Drop.
        let _ = exit(&self.owner);
    }
}

impl Strategy {
    /// Enter this strategy's scope on this thread (TensorFlow's `with strategy.scope():`):
    /// until the guard is dropped, [`Variable::new`] makes this strategy's kind of variable.
    /// Inside another strategy's scope it is an error.
    pub fn scope(self: &Arc<Self>) -> Result<Scope> {
        Scope::entered(Owner::Strategy(self.clone()))
    }

    /// Make this strategy's kind of variable from `initial` (the chief's, on every worker):
    /// one copy per replica, or one copy in all under CentralStorageStrategy.
    pub fn variable<T: Element>(
        &self,
        initial: &[T],
        aggregation: Aggregation,
    ) -> Result<Variable<T>> {
        // In the scope, outside `run`: the replicas' threads are not in the caller's scope, and
        // a worker's chief-value broadcast must not fall among a step's collectives.
        drop(self.outside_run().map_err(|_| {
            Error::config(
                "variables are made in the strategy's scope outside run (as TensorFlow's first \
                 step makes them), not inside a replica function",
            )
        })?);
        let kind = match self.kind() {
            StrategyKind::CentralStorage => Kind::Central(self.central_variable(initial)?),
            _ => Kind::Mirrored(self.mirrored_variable(initial)?),
        };
        Ok(Variable { kind, aggregation })
    }
}

impl Coordinator {
    /// Enter the scope of this ParameterServerStrategy on this thread (TensorFlow's `with
    /// strategy.scope():` on the chief): until the guard is dropped, [`Variable::new`] makes a
    /// variable on the parameter servers ([`ShardedVariable`]), sharded by the strategy's
    /// partitioner. Inside another strategy's scope it is an error.
    pub fn scope(self: &Arc<Self>) -> Result<Scope> {
        Scope::entered(Owner::Coordinator(self.clone()))
    }

    /// Make a variable on the parameter servers from `initial` (f32, f64, f16 or bf16),
    /// sharded by the strategy's partitioner: a step's pushes without a rule of their own
    /// subtract from it (`w -= g`, what `assign_sub` sends).
    pub fn variable<T: Element>(
        self: &Arc<Self>,
        initial: &[T],
        aggregation: Aggregation,
    ) -> Result<Variable<T>> {
        let values = ps_values(initial, "ParameterServerStrategy: a variable")?;
        let name = format!("Variable:{}", self.shards().len());
        let id = self.create_variable_with(&name, values, super::ps::sgd(1.0), None)?;
        Ok(Variable {
            kind: Kind::Sharded(ShardedVariable {
                coordinator: self.clone(),
                id,
                len: initial.len(),
                _t: PhantomData,
            }),
            aggregation,
        })
    }
}

/// `v` as the parameter servers hold it (their float types), or an error, `what` first, naming
/// the type.
fn ps_values<T: Element>(v: &[T], what: &str) -> Result<Values> {
    Values::from_bytes(T::DTYPE, bytemuck::cast_slice(v))
        .map_err(|why| Error::config(format!("{what}: {why}")))
}

/// A variable made in a ParameterServerStrategy's scope, on the chief: held on the ps tasks in
/// shards. A scheduled step reads it on a worker as [`StepContext::variables`]`()[id.index()]`
/// and updates it with [`StepContext::push`] (or by its gradient, which the variable's rule
/// subtracts); the chief reads and sets it here.
///
/// [`StepContext::variables`]: super::ps::StepContext::variables
/// [`StepContext::push`]: super::ps::StepContext::push
pub struct ShardedVariable<T> {
    coordinator: Arc<Coordinator>,
    id: VariableId,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> ShardedVariable<T> {
    /// Its place among the job's variables (a step's [`StepContext::variables`]).
    ///
    /// [`StepContext::variables`]: super::ps::StepContext::variables
    pub fn id(&self) -> VariableId {
        self.id
    }

    /// Its shards on the ps tasks.
    pub fn shards(&self) -> usize {
        self.coordinator
            .shards()
            .get(self.id.index())
            .copied()
            .unwrap_or(0)
    }

    /// Its value as the ps tasks hold it now.
    pub fn value(&self) -> Result<Vec<T>> {
        let v = self.coordinator.read_values(self.id)?;
        if v.dtype() != T::DTYPE || v.len() != self.len {
            return Err(Error::System {
                what: format!("variable {}", self.id.index()),
                message: format!(
                    "the ps tasks hold {} {} elements for a variable of {} {}",
                    v.len(),
                    v.dtype(),
                    self.len,
                    T::DTYPE
                ),
            });
        }
        let mut out = vec![T::zeroed(); self.len];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(v.as_bytes());
        Ok(out)
    }

    /// Set it on the ps tasks (a restored checkpoint, a value of the caller's); steps running
    /// meanwhile may push onto the old value or the new.
    pub fn assign(&self, value: &[T]) -> Result<()> {
        self.check_len(value.len(), "assign")?;
        self.coordinator
            .assign_values(self.id, ps_values(value, "assign")?)
    }

    /// Add `delta` on the ps tasks, as a step's push does: none of the steps' pushes is lost.
    pub fn assign_add(&self, delta: &[T]) -> Result<()> {
        self.check_len(delta.len(), "assign_add")?;
        // The variable's rule subtracts what is pushed: push the negated delta (exact in
        // every type the ps tasks hold).
        let negated = match ps_values(delta, "assign_add")? {
            Values::F32(v) => Values::F32(v.into_iter().map(|x| -x).collect()),
            Values::F64(v) => Values::F64(v.into_iter().map(|x| -x).collect()),
            Values::F16(v) => Values::F16(v.into_iter().map(|x| -x).collect()),
            Values::BF16(v) => Values::BF16(v.into_iter().map(|x| -x).collect()),
        };
        self.coordinator.push_values(self.id, negated, None)
    }

    /// Subtract `delta` on the ps tasks, as a step's push does.
    pub fn assign_sub(&self, delta: &[T]) -> Result<()> {
        self.check_len(delta.len(), "assign_sub")?;
        self.coordinator
            .push_values(self.id, ps_values(delta, "assign_sub")?, None)
    }

    /// The error of a replica's call on it: `what` cannot be done here, and what can.
    fn not_replicated(&self, what: &str) -> Error {
        Error::config(format!(
            "variable {} lives on the parameter servers and is not {what}: a scheduled step \
             reads it on a worker (StepContext::variables) and pushes to it; the chief reads \
             and sets it through as_sharded()",
            self.id.index()
        ))
    }

    fn check_len(&self, n: usize, what: &str) -> Result<()> {
        if n != self.len {
            return Err(Error::config(format!(
                "{what}: {n} elements for variable {} of {}",
                self.id.index(),
                self.len
            )));
        }
        Ok(())
    }
}

/// A variable made in whatever strategy's scope is current ([`Variable::new`]): the strategy's
/// kind, with the aggregation its cross-replica updates use.
pub struct Variable<T> {
    kind: Kind<T>,
    aggregation: Aggregation,
}

enum Kind<T> {
    Mirrored(MirroredVariable<T>),
    Central(CentralVariable<T>),
    Sharded(ShardedVariable<T>),
}

impl<T: Element> Variable<T> {
    /// TensorFlow's `tf.Variable(initial)` (aggregation: none, the first replica's update):
    /// the current scope's strategy's kind of variable, or outside any scope the default
    /// strategy's, a plain variable of one copy.
    pub fn new(initial: &[T]) -> Result<Variable<T>> {
        Variable::with_aggregation(initial, Aggregation::OnlyFirstReplica)
    }

    /// [`Variable::new`] whose cross-replica updates combine the replicas' by `aggregation`.
    pub fn with_aggregation(initial: &[T], aggregation: Aggregation) -> Result<Variable<T>> {
        match innermost() {
            Some(Owner::Strategy(s)) => s.variable(initial, aggregation),
            Some(Owner::Coordinator(c)) => c.variable(initial, aggregation),
            None => Ok(Variable {
                kind: Kind::Mirrored(MirroredVariable::new(initial, 1)),
                aggregation,
            }),
        }
    }

    /// How the replicas' updates are combined.
    pub fn aggregation(&self) -> Aggregation {
        self.aggregation
    }

    /// Its mirrored form (every strategy's but CentralStorageStrategy's and
    /// ParameterServerStrategy's), for an [`Optimizer`](super::Optimizer).
    pub fn as_mirrored(&self) -> Option<&MirroredVariable<T>> {
        match &self.kind {
            Kind::Mirrored(m) => Some(m),
            _ => None,
        }
    }

    /// Its stored-once form (CentralStorageStrategy's).
    pub fn as_central(&self) -> Option<&CentralVariable<T>> {
        match &self.kind {
            Kind::Central(c) => Some(c),
            _ => None,
        }
    }

    /// Its form on the parameter servers (ParameterServerStrategy's).
    pub fn as_sharded(&self) -> Option<&ShardedVariable<T>> {
        match &self.kind {
            Kind::Sharded(v) => Some(v),
            _ => None,
        }
    }

    /// The variable's value (on the parameter servers: read from them, which may fail).
    pub fn value(&self) -> Result<Vec<T>> {
        match &self.kind {
            Kind::Mirrored(m) => Ok(m.value()),
            Kind::Central(c) => Ok(c.value()),
            Kind::Sharded(v) => v.value(),
        }
    }

    /// Its elements.
    pub fn len(&self) -> usize {
        match &self.kind {
            Kind::Mirrored(m) => m.len(),
            Kind::Central(c) => c.len(),
            Kind::Sharded(v) => v.len,
        }
    }

    /// True for a variable of no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value the replica running `ctx` reads (its copy, or the one copy). A variable on
    /// the parameter servers has no replica of a strategy's `run`: an error.
    pub fn read_in(&self, ctx: &ReplicaContext<'_>) -> Result<Vec<T>> {
        match &self.kind {
            Kind::Mirrored(m) => Ok(m.read_in(ctx)),
            Kind::Central(c) => Ok(c.value()),
            Kind::Sharded(v) => Err(v.not_replicated("read in a replica")),
        }
    }

    /// From outside `run`: combine the replicas' `updates` by the variable's aggregation and
    /// add the result.
    pub fn assign_add(&self, strategy: &Strategy, updates: &PerReplica<Vec<T>>) -> Result<()> {
        match &self.kind {
            Kind::Mirrored(m) => m.assign_add(strategy, updates, self.aggregation),
            Kind::Central(c) => c.assign_add(strategy, updates, self.aggregation),
            Kind::Sharded(v) => Err(v.not_replicated("updated through a strategy's replicas")),
        }
    }

    /// From outside `run`: combine and subtract.
    pub fn assign_sub(&self, strategy: &Strategy, updates: &PerReplica<Vec<T>>) -> Result<()> {
        match &self.kind {
            Kind::Mirrored(m) => m.assign_sub(strategy, updates, self.aggregation),
            Kind::Central(c) => c.assign_sub(strategy, updates, self.aggregation),
            Kind::Sharded(v) => Err(v.not_replicated("updated through a strategy's replicas")),
        }
    }

    /// From outside `run`: combine and set.
    pub fn assign(&self, strategy: &Strategy, values: &PerReplica<Vec<T>>) -> Result<()> {
        match &self.kind {
            Kind::Mirrored(m) => m.assign(strategy, values, self.aggregation),
            Kind::Central(c) => c.assign(strategy, values, self.aggregation),
            Kind::Sharded(v) => Err(v.not_replicated("updated through a strategy's replicas")),
        }
    }
}
