//! [`Args`]: a call's positional and keyword values over one tensor
//! table, and the [`args!`](crate::args) macro.

use std::fmt;

use tch::Tensor;

use super::{Handle, Payload, absorb, clone_tensors};
use crate::abi::Value;
use crate::error::{Error, Result};

/// A call's arguments: positional values, keyword values, one tensor table.
pub struct Args {
    /// Positional arguments.
    pub positional: Vec<Value>,
    /// Keyword arguments, in order.
    pub kwargs: Vec<(String, Value)>,
    /// The tensors both refer to.
    pub tensors: Vec<Tensor>,
    /// The RRefs both refer to (`Value::RRef(i)`).
    pub rrefs: Vec<Handle>,
}

impl Clone for Args {
    fn clone(&self) -> Self {
        Args {
            positional: self.positional.clone(),
            kwargs: self.kwargs.clone(),
            tensors: clone_tensors(&self.tensors),
            rrefs: self.rrefs.clone(),
        }
    }
}

impl fmt::Debug for Args {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Args")
            .field("positional", &self.positional)
            .field("kwargs", &self.kwargs)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Default for Args {
    fn default() -> Self {
        Self::new()
    }
}

impl Args {
    /// No arguments.
    pub fn new() -> Self {
        Args {
            positional: Vec::new(),
            kwargs: Vec::new(),
            tensors: Vec::new(),
            rrefs: Vec::new(),
        }
    }

    /// Appends a positional argument.
    #[must_use]
    pub fn arg(mut self, v: impl Into<Payload>) -> Self {
        let v = absorb(&mut self.tensors, &mut self.rrefs, v.into());
        self.positional.push(v);
        self
    }

    /// Puts `leading` in front of the positional arguments: a wrapper's own
    /// arguments before its caller's, as in `_local_invoke(rref, name,
    /// *args)`.
    #[must_use]
    pub fn prepend(mut self, leading: impl IntoIterator<Item = Payload>) -> Self {
        let mut positional: Vec<Value> = leading
            .into_iter()
            .map(|v| absorb(&mut self.tensors, &mut self.rrefs, v))
            .collect();
        positional.append(&mut self.positional);
        self.positional = positional;
        self
    }

    /// Appends a keyword argument.
    #[must_use]
    pub fn kwarg(mut self, name: impl Into<String>, v: impl Into<Payload>) -> Self {
        let v = absorb(&mut self.tensors, &mut self.rrefs, v.into());
        self.kwargs.push((name.into(), v));
        self
    }

    /// The number of positional arguments.
    pub fn len(&self) -> usize {
        self.positional.len()
    }

    /// Whether there are no arguments at all.
    pub fn is_empty(&self) -> bool {
        self.positional.is_empty() && self.kwargs.is_empty()
    }

    fn sub(&self, v: &Value) -> Payload {
        Payload {
            value: v.clone(),
            tensors: clone_tensors(&self.tensors),
            rrefs: self.rrefs.clone(),
        }
    }

    /// Positional argument `i`.
    ///
    /// # Errors
    /// `TypeError` if there is no such argument.
    pub fn get(&self, i: usize) -> Result<Payload> {
        self.positional
            .get(i)
            .map(|v| self.sub(v))
            .ok_or_else(|| Error::type_error(format!("missing required positional argument {i}")))
    }

    /// Keyword argument `name`, if given.
    pub fn kwarg_value(&self, name: &str) -> Option<Payload> {
        self.kwargs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| self.sub(v))
    }

    /// A parameter given either as positional argument `i` or as keyword
    /// `name`, as Python binds it.
    ///
    /// # Errors
    /// `TypeError` if it is given neither way, or both ways.
    pub fn param(&self, i: usize, name: &str) -> Result<Payload> {
        match (self.positional.get(i), self.kwarg_value(name)) {
            (Some(_), Some(_)) => Err(Error::type_error(format!(
                "got multiple values for argument '{name}'"
            ))),
            (Some(v), None) => Ok(self.sub(v)),
            (None, Some(v)) => Ok(v),
            (None, None) => Err(Error::type_error(format!(
                "missing required argument '{name}'"
            ))),
        }
    }

    /// Checks the arity of a function taking `min..=max` positional
    /// arguments and no unknown keywords (`known`), with Python's texts.
    ///
    /// # Errors
    /// `TypeError` naming `function` when the call does not fit.
    pub fn check_arity(
        &self,
        function: &str,
        min: usize,
        max: usize,
        known: &[&str],
    ) -> Result<()> {
        let given = self.positional.len() + self.kwargs.len();
        if self.positional.len() > max {
            return Err(Error::type_error(format!(
                "{function}() takes {max} positional arguments but {} were given",
                self.positional.len()
            )));
        }
        if let Some((k, _)) = self
            .kwargs
            .iter()
            .find(|(k, _)| !known.contains(&k.as_str()))
        {
            return Err(Error::type_error(format!(
                "{function}() got an unexpected keyword argument '{k}'"
            )));
        }
        if given < min {
            let missing = min - given;
            return Err(Error::type_error(format!(
                "{function}() missing {missing} required positional argument{}",
                if missing == 1 { "" } else { "s" }
            )));
        }
        Ok(())
    }

    /// All positional arguments as one tuple payload.
    pub fn to_tuple(&self) -> Payload {
        Payload {
            value: Value::Tuple(self.positional.clone()),
            tensors: clone_tensors(&self.tensors),
            rrefs: self.rrefs.clone(),
        }
    }
}

/// Builds [`Args`] from positional values: `args![t, 1, "x"]`.
#[macro_export]
macro_rules! args {
    () => { $crate::Args::new() };
    ($($v:expr),+ $(,)?) => { $crate::Args::new()$(.arg($v))+ };
}
