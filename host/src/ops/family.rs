//! The op families a worker serves by default: named lists of ops that
//! compute on tensors (POL-2).
//!
//! What this module owns: [`Family`] and [`FAMILIES`], the curated lists
//! themselves, and nothing else. Every member must be a registered operator
//! that can be called by name, and the schemas of every overload the policy
//! lets through must be free of hazards: the registry walk in
//! `super::policy`'s tests checks both against the libtorch this host
//! links, so the lists hold no dead names and no unsafe op slips in with a
//! libtorch upgrade.
//!
//! What is left out on purpose, with the reason, where it is not obvious
//! from the policy's schema check (which refuses storages, streams, file
//! names, raw pointers, generators callers would pass and opaque types on
//! its own):
//! - uninitialized memory: `empty`, `empty_like`, `empty_strided`,
//!   `new_empty`, `resize_` hand back whatever the allocator held before,
//!   including other callers' data;
//! - raw views of storage: `as_strided`, `set_`, `unsafe_*`, `_unsafe_view`;
//! - sparse tensors built from caller indices: `sparse_coo_tensor` does not
//!   check its indices against the size (`to_dense` then writes out of
//!   bounds: a segfault, tried on libtorch 2.13), and `indices` returns the
//!   sparse tensor's own index storage, which in-place ops on an RRef could
//!   then corrupt the same way (tried too); sparse tensors arriving over the
//!   wire have their indices checked (`crate::tensor`);
//! - ops that take pivots or targets indexing memory with weaker checks in
//!   past libtorch releases: `lu_unpack`, `lu_solve`, `linalg_lu_solve`,
//!   `linalg_ldl_solve`, `max_unpool*`, `embedding_bag`,
//!   `multilabel_margin_loss`, `multi_margin_loss`;
//! - process-wide state: `manual_seed`, `seed`, `set_grad_enabled`,
//!   `backward`, `retain_grad`, `requires_grad_` (the host owns the
//!   generator and grad mode; plugins have their own autograd requests);
//! - TorchScript's list, dict and string builtins (`append`, `keys`,
//!   `format`, `warn`, `wait`, ...): no tensor computation.
//!
//! No member may crash the worker on any arguments (issue 43). The op
//! fuzzer (`host/tests/op_fuzz.rs`, in CI) calls every member with
//! boundary arguments generated from its schemas; a crash it finds is
//! either refused before the kernel runs (enum codes where values are
//! converted, kernel preconditions in `host/torch-sys/shim/guards.cpp`:
//! `remainder`, `gcd`, `lcm`, `div` with `rounding_mode='trunc'`, `range`,
//! `max_pool1d`, `combinations`, `tensor_split`) or, if no check up front can make it safe, the op leaves
//! its family with the reason here. None has had to leave so far.

/// A named group of ops the default policy serves (`@arithmetic` in
/// rules).
#[derive(Debug)]
pub struct Family {
    /// The family's name, without the `@` rules write before it.
    pub name: &'static str,
    /// What its ops do, one line.
    pub summary: &'static str,
    /// The namespace of its members: `aten`, or `builtins` for Python's.
    pub(crate) namespace: &'static str,
    /// Base names (no namespace, no overload).
    pub(crate) members: &'static [&'static str],
    /// Whether each member's in-place form (`add_` for `add`) belongs to the
    /// family too, where libtorch registers one.
    pub(crate) in_place: bool,
}

/// Families are equal when their names are: each name is defined once.
impl PartialEq for Family {
    fn eq(&self, other: &Family) -> bool {
        self.name == other.name
    }
}

impl Eq for Family {}

impl Family {
    /// Whether the op `base` of `namespace` is a member (an in-place form
    /// counts when the family takes them).
    pub fn contains(&self, namespace: &str, base: &str) -> bool {
        if namespace != self.namespace {
            return false;
        }
        if self.members.contains(&base) {
            return true;
        }
        self.in_place
            && base
                .strip_suffix('_')
                .is_some_and(|plain| !plain.ends_with('_') && self.members.contains(&plain))
    }

    /// Every member as the registry names it (`aten::add`,
    /// `builtins.min`), without in-place forms.
    pub fn member_names(&self) -> impl Iterator<Item = String> + '_ {
        self.members.iter().map(move |m| match self.namespace {
            "builtins" => format!("builtins.{m}"),
            ns => format!("{ns}::{m}"),
        })
    }
}

/// The family named `name` (without the `@`).
pub fn family(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.name == name)
}

mod table;

pub use table::FAMILIES;

#[cfg(test)]
mod tests;
