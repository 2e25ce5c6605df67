//! Gating by-name calls: an [`OpGate`] decides, before anything runs,
//! whether a call may run the op it resolved to ([`Admission`]).

use super::Operator;
use crate::error::OpError;
use crate::value::OpValue;

/// One op a by-name call is about to run, as an [`OpGate`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct Admission<'a> {
    /// What runs: a registered operator, or one of Python's builtins
    /// ([`BUILTINS`](crate::BUILTINS), which no registry holds).
    pub target: Target<'a>,
    /// The call's positional arguments.
    pub args: &'a [OpValue],
    /// The call's keyword arguments.
    pub kwargs: &'a [(String, OpValue)],
    /// Whether it is called as a tensor method ([`Operator::call_method`]),
    /// which changes how arguments bind (trailing ints fill an `int[]`).
    pub method: bool,
}

/// What an [`Admission`] would run.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// A registered operator (all its overloads): its registry name is
    /// [`Operator::name`] whichever spelling the caller used.
    Op(&'a Operator),
    /// A Python builtin, by its qualified name (`builtins.min`).
    Builtin(&'a str),
}

impl Admission<'_> {
    /// The schema of the overload the call would run (without running it),
    /// or `None` for a Python builtin.
    ///
    /// # Errors
    ///
    /// [`OpError::NoMatchingSchema`] if no overload accepts the arguments.
    pub fn matching_schema(&self) -> Result<Option<&str>, OpError> {
        match self.target {
            Target::Builtin(_) => Ok(None),
            Target::Op(op) => op
                .matching_schema_inner(self.args, self.kwargs, self.method)
                .map(Some),
        }
    }
}

/// Decides, before anything runs, whether a by-name call may run the op it
/// resolved to: [`call_op_gated`] and [`call_method_gated`] ask it once per
/// op they would run (a method call that falls back from `aten::<name>` to
/// `prim::<name>` asks for each), after resolving the name and before
/// calling. Names that resolve to nothing never reach it: they fail with
/// [`OpError::UnknownOp`] or [`OpError::UnknownMethod`] as before.
pub trait OpGate {
    /// `Ok` to run `admission`'s op; an error fails the call with it, and
    /// nothing runs.
    ///
    /// # Errors
    ///
    /// Whatever refusal the gate makes.
    fn admit(&self, admission: &Admission<'_>) -> Result<(), OpError>;
}

/// The gate of callers that may run anything: the host's own code and
/// tests, never a name a peer or a guest chose.
#[derive(Debug, Clone, Copy, Default)]
pub struct AdmitAll;

impl OpGate for AdmitAll {
    fn admit(&self, _: &Admission<'_>) -> Result<(), OpError> {
        Ok(())
    }
}
