//! `strategy.scope()`: the strategy whose variables are made on this thread.
//!
//! TensorFlow's `with strategy.scope(): v = tf.Variable(...)` makes `v` the strategy's kind of
//! variable (mirrored, stored once) without the code that makes it knowing which strategy runs
//! it: a model's constructor written once runs under every strategy. Here the scope is a guard
//! ([`Strategy::scope`]) that sets this thread's current strategy until it is dropped, and
//! [`Variable::new`] makes its variable with the current strategy, or, outside any scope, with
//! the default strategy (one replica, one copy). As in TensorFlow, a second strategy's scope
//! cannot be entered inside a first one's; the same strategy's scope may nest.

use std::cell::RefCell;
use std::sync::Arc;

use super::{Aggregation, CentralVariable, MirroredVariable, PerReplica, ReplicaContext};
use super::{Strategy, StrategyKind};
use crate::dtype::Element;
use crate::error::{Error, Result};

thread_local! {
    /// The scopes entered on this thread, innermost last (one strategy, entered as many times
    /// as its scopes nest).
    static SCOPES: RefCell<Vec<Arc<Strategy>>> = const { RefCell::new(Vec::new()) };
}

/// Make `strategy` this thread's current strategy until [`exit_scope`] (the guard-free form of
/// [`Strategy::scope`], for callers that cannot hold a guard: the C ABI's
/// `tutti_strategy_scope_begin`). Inside another strategy's scope it is an error.
pub fn enter_scope(strategy: &Arc<Strategy>) -> Result<()> {
    SCOPES.with(|s| {
        let mut s = s.borrow_mut();
        if let Some(top) = s.last() {
            if !Arc::ptr_eq(top, strategy) {
                return Err(Error::config(format!(
                    "scope: this thread is inside a {}'s scope; a {}'s cannot be entered in it \
                     (mixing strategies, as TensorFlow refuses)",
                    top.kind().name(),
                    strategy.kind().name()
                )));
            }
        }
        s.push(strategy.clone());
        Ok(())
    })
}

/// Leave `strategy`'s innermost scope on this thread (see [`enter_scope`]); an error where it
/// is not this thread's current strategy.
pub fn exit_scope(strategy: &Arc<Strategy>) -> Result<()> {
    SCOPES.with(|s| {
        let mut s = s.borrow_mut();
        match s.last() {
            Some(top) if Arc::ptr_eq(top, strategy) => {
                s.pop();
                Ok(())
            }
            _ => Err(Error::config(
                "scope: this strategy's scope is not the one this thread is in (each scope is \
                 left on the thread that entered it)",
            )),
        }
    })
}

/// The strategy of this thread's innermost scope (TensorFlow's `tf.distribute.get_strategy()`
/// inside a scope); `None` outside any, where variables are the default strategy's.
pub fn current_strategy() -> Option<Arc<Strategy>> {
    SCOPES.with(|s| s.borrow().last().cloned())
}

/// A strategy's scope on this thread ([`Strategy::scope`]): left when dropped.
#[must_use = "the scope ends when this guard is dropped"]
pub struct Scope {
    strategy: Arc<Strategy>,
    /// A scope is left on the thread that entered it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Scope {
    /// The scope's strategy.
    pub fn strategy(&self) -> &Arc<Strategy> {
        &self.strategy
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        // Entered on this thread by this guard, which cannot move to another: always the
        // innermost (a guard dropped out of order leaves the innermost scope of the same
        // strategy, which is equivalent). Nothing to report from Drop.
        let _ = exit_scope(&self.strategy);
    }
}

impl Strategy {
    /// Enter this strategy's scope on this thread (TensorFlow's `with strategy.scope():`):
    /// until the guard is dropped, [`Variable::new`] makes this strategy's kind of variable.
    /// Inside another strategy's scope it is an error.
    pub fn scope(self: &Arc<Self>) -> Result<Scope> {
        enter_scope(self)?;
        Ok(Scope {
            strategy: self.clone(),
            _not_send: std::marker::PhantomData,
        })
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

/// A variable made in whatever strategy's scope is current ([`Variable::new`]): the strategy's
/// kind, with the aggregation its cross-replica updates use.
pub struct Variable<T> {
    kind: Kind<T>,
    aggregation: Aggregation,
}

enum Kind<T> {
    Mirrored(MirroredVariable<T>),
    Central(CentralVariable<T>),
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
        match current_strategy() {
            Some(s) => s.variable(initial, aggregation),
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

    /// Its mirrored form (every strategy's but CentralStorageStrategy's), for an
    /// [`Optimizer`](super::Optimizer).
    pub fn as_mirrored(&self) -> Option<&MirroredVariable<T>> {
        match &self.kind {
            Kind::Mirrored(m) => Some(m),
            Kind::Central(_) => None,
        }
    }

    /// Its stored-once form (CentralStorageStrategy's).
    pub fn as_central(&self) -> Option<&CentralVariable<T>> {
        match &self.kind {
            Kind::Central(c) => Some(c),
            Kind::Mirrored(_) => None,
        }
    }

    /// The variable's value.
    pub fn value(&self) -> Vec<T> {
        match &self.kind {
            Kind::Mirrored(m) => m.value(),
            Kind::Central(c) => c.value(),
        }
    }

    /// Its elements.
    pub fn len(&self) -> usize {
        match &self.kind {
            Kind::Mirrored(m) => m.len(),
            Kind::Central(c) => c.value().len(),
        }
    }

    /// True for a variable of no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value the replica running `ctx` reads (its copy, or the one copy).
    pub fn read_in(&self, ctx: &ReplicaContext<'_>) -> Vec<T> {
        match &self.kind {
            Kind::Mirrored(m) => m.read_in(ctx),
            Kind::Central(c) => c.value(),
        }
    }

    /// From outside `run`: combine the replicas' `updates` by the variable's aggregation and
    /// add the result.
    pub fn assign_add(&self, strategy: &Strategy, updates: &PerReplica<Vec<T>>) -> Result<()> {
        match &self.kind {
            Kind::Mirrored(m) => m.assign_add(strategy, updates, self.aggregation),
            Kind::Central(c) => c.assign_add(strategy, updates, self.aggregation),
        }
    }

    /// From outside `run`: combine and subtract.
    pub fn assign_sub(&self, strategy: &Strategy, updates: &PerReplica<Vec<T>>) -> Result<()> {
        match &self.kind {
            Kind::Mirrored(m) => m.assign_sub(strategy, updates, self.aggregation),
            Kind::Central(c) => c.assign_sub(strategy, updates, self.aggregation),
        }
    }

    /// From outside `run`: combine and set.
    pub fn assign(&self, strategy: &Strategy, values: &PerReplica<Vec<T>>) -> Result<()> {
        match &self.kind {
            Kind::Mirrored(m) => m.assign(strategy, values, self.aggregation),
            Kind::Central(c) => c.assign(strategy, values, self.aggregation),
        }
    }
}
