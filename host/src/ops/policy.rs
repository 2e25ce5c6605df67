//! [`OpPolicy`]: which builtin ops a worker runs for the peers and plugins
//! that name them, decided before anything runs (deny by default).
//!
//! (Public as `wasmrpc::op_policy`, with the families and schema hazards it
//! decides by.)
//!
//! What this module owns: the rules (`allow PATTERN`, `deny PATTERN`, from
//! Rust, a policy file or the command line), the verdict for each op and its
//! cache, the refusal texts, and the [`OpGate`] every caller-chosen op name
//! passes ([`PolicyGate`]). The families a default policy serves are in
//! [`super::family`]; reading schemas for hazards is [`super::schema`]'s;
//! resolving names and calling ops are `wasmrpc-torch-sys`'s.
//!
//! How a verdict is reached for an op (the registry's name: `aten::add`,
//! `builtins.min`; every spelling a caller may use, `torch.ops.aten.add`, a
//! bare method name `add`, reaches the gate as that one name because the gate
//! sees the resolved operator), in this order:
//! 1. a `deny` rule that matches refuses it;
//! 2. an `allow` rule naming it exactly grants it, every overload;
//! 3. an `allow` rule matching it by glob or family, or else a default
//!    family holding it, grants it except for its overloads whose schemas
//!    are unsafe (POL-3), which are withheld; if every overload is unsafe,
//!    the op is refused;
//! 4. anything else is refused: an op of another namespace than `aten`, a
//!    private op (`_` first), one whose schema is unsafe, or one in no
//!    family.
//!
//! Deny rules always win, whatever their order. Patterns: a name
//! (`aten::from_file`, `torch.ops.aten.from_file`, or a bare `from_file`,
//! all `aten::from_file`), a glob with `*` (`aten::linalg_*`, `prim::*`, `*`
//! for every op), or a family (`@random`). An allow glob's `*` does not
//! match a leading `_` (as a shell's `*` skips dot files): write
//! `aten::_*` to mean private ops. Rules name ops, not overloads.
//!
//! Invariants:
//! - POL-1: every op whose name a peer or a plugin chose runs through
//!   [`PolicyGate`] (builtin RPCs, RRef proxies' tensor methods, plugins'
//!   tensor ops), and the gate sees the resolved operator, so no spelling
//!   reaches an op the policy refuses; only the host's own code calls
//!   ungated (`AdmitAll`).
//! - POL-2: the default policy serves the families of [`super::family`]
//!   and Python's `builtins.min`/`max`, nothing else; no family member has
//!   an overload with an unsafe schema that a call can reach (the registry
//!   walk in the tests checks this against the linked libtorch).
//! - POL-3: an unsafe schema is one with a parameter that is a `Storage`, a
//!   `Stream`, a `Generator` a caller would pass, an address, a file name, or
//!   an opaque or generic type (`Any`, a type variable, a class, a container
//!   of TorchScript values); unknown types count as unsafe.
//! - POL-4: a withheld overload never runs: a call that could bind one
//!   (its argument kinds fit) is matched by libtorch first and refused if it
//!   would run it; calls whose kinds cannot fit (a tensor for a `t[]`) skip
//!   that matching, so the common case costs one cached lookup.
//! - POL-5: a verdict is computed once per op and policy and cached (only
//!   for names the registry resolves, so a peer's garbage does not grow the
//!   cache); a cache hit allocates nothing.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::Path;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use wasmrpc_torch_sys::{
    Admission, BUILTINS, ErrorKind, OpError, OpGate, Operator, Target, qualified_name,
};

pub use super::family::{FAMILIES, Family, family};
pub use super::schema::{Hazard, HazardKind, Overload};
use crate::error::{Error, Result};

mod rules;

pub(crate) use rules::glob_match;
pub use rules::{Action, Pattern, Rule};

/// Why an op is served.
#[derive(Debug, Clone)]
pub enum Grant {
    /// A default family holds it.
    Family(&'static Family),
    /// An allow rule matches it.
    Rule(Rule),
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Grant::Family(family) => write!(f, "@{}", family.name),
            Grant::Rule(rule) => write!(f, "{rule}"),
        }
    }
}

/// Why an op is refused.
#[derive(Debug, Clone)]
pub enum Denial {
    /// A deny rule matches it.
    Rule(Rule),
    /// It is in another namespace than `aten` (`prim`, `quantized`, ...).
    OtherNamespace(String),
    /// Its name starts with `_`: libtorch's private ops.
    Private,
    /// Every overload's schema is unsafe (POL-3); the first hazard.
    UnsafeSchema(Hazard),
    /// No family holds it and no rule allows it.
    NotInFamily,
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denial::Rule(rule) => write!(f, "denied by rule `{rule}`"),
            Denial::OtherNamespace(ns) => write!(
                f,
                "the op is in namespace {ns}, which this worker's op policy does not serve"
            ),
            Denial::Private => write!(
                f,
                "the op is private (its name starts with `_`) and not in this worker's op policy"
            ),
            Denial::UnsafeSchema(hazard) => write!(
                f,
                "the op {hazard}, which this worker's op policy does not serve"
            ),
            Denial::NotInFamily => write!(f, "the op is not in this worker's op policy"),
        }
    }
}

/// The policy's decision for one op, every overload.
#[derive(Debug, Clone)]
pub enum Verdict {
    /// Served, except for the withheld overloads (POL-4).
    Allowed {
        /// Why.
        by: Grant,
        /// Overloads with unsafe schemas that calls never reach.
        withheld: Vec<Overload>,
    },
    /// Refused.
    Denied(Denial),
}

impl Verdict {
    /// Whether the op is served (some overloads may be withheld).
    pub fn is_allowed(&self) -> bool {
        matches!(self, Verdict::Allowed { .. })
    }
}

/// The hint a refusal ends with: how an operator allows `op`.
fn how_to_allow(op: &str) -> String {
    format!("allow it with --allow-op {op}, or OpPolicy::allow in RpcBackendOptions::op_policy")
}

/// The `RuntimeError` for a refused op (`op` as the registry names it).
pub(crate) fn refusal(worker: &str, op: &str, denial: &Denial) -> OpError {
    let message = match denial {
        // Allowing cannot beat a deny rule: say which rule to remove.
        Denial::Rule(_) => {
            format!("{worker} does not run {op}: {denial} (remove that rule to serve it)")
        }
        _ => format!(
            "{worker} does not run {op}: {denial} ({})",
            how_to_allow(op)
        ),
    };
    OpError::Rejected {
        kind: ErrorKind::RuntimeError,
        message,
    }
}

/// The `RuntimeError` for a call that would run a withheld overload.
fn withheld_refusal(worker: &str, op: &str, overload: &Overload) -> OpError {
    OpError::Rejected {
        kind: ErrorKind::RuntimeError,
        message: format!(
            "{worker} does not run {}: the overload {}, which this worker's op policy does not \
             serve ({}, to serve every overload of {op})",
            overload.schema(),
            overload.hazard,
            how_to_allow(op)
        ),
    }
}

/// A worker's op policy: which builtin ops it runs for peers and plugins
/// (see the module docs for the rules and their order).
///
/// Cheap to share (`Arc<OpPolicy>` in
/// [`RpcBackendOptions::op_policy`](crate::RpcBackendOptions::op_policy));
/// verdicts are cached inside (POL-5), so one policy serves any number of
/// calls at once. Cloning copies the rules, not the cache.
///
/// ```
/// use wasmrpc::OpPolicy;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The default families, plus one op for a trusted plugin, minus sampling.
/// let policy = OpPolicy::default().allow("aten::from_file")?.deny("@random")?;
/// assert!(policy.verdict("aten::add")?.is_allowed());
/// assert!(policy.verdict("torch.ops.aten.from_file")?.is_allowed());
/// assert!(!policy.verdict("aten::rand")?.is_allowed());
/// assert!(!policy.verdict("prim::dtype")?.is_allowed());
/// # Ok(()) }
/// ```
pub struct OpPolicy {
    /// Whether the default families grant (POL-2).
    defaults: bool,
    rules: Vec<Rule>,
    /// Registry name → verdict (POL-5).
    verdicts: RwLock<Verdicts>,
}

/// The verdict cache: keys are short op names, hashed with FNV-1a (a few
/// nanoseconds, where SipHash costs more than the rest of the check; the
/// keys are names the registry resolved, not attacker-chosen strings).
type Verdicts = HashMap<String, Arc<Verdict>, BuildHasherDefault<Fnv>>;

/// FNV-1a, 64 bits.
#[derive(Debug, Clone, Copy)]
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

impl Default for OpPolicy {
    /// The default families and nothing else.
    fn default() -> Self {
        OpPolicy::with_defaults(true)
    }
}

impl Clone for OpPolicy {
    fn clone(&self) -> Self {
        OpPolicy {
            defaults: self.defaults,
            rules: self.rules.clone(),
            verdicts: RwLock::new(Verdicts::default()),
        }
    }
}

impl fmt::Debug for OpPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpPolicy")
            .field("defaults", &self.defaults)
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

impl OpPolicy {
    fn with_defaults(defaults: bool) -> OpPolicy {
        OpPolicy {
            defaults,
            rules: Vec::new(),
            verdicts: RwLock::new(Verdicts::default()),
        }
    }

    /// The default policy, one per process, so workers that keep the default
    /// share its verdict cache.
    pub fn shared_default() -> Arc<OpPolicy> {
        static SHARED: OnceLock<Arc<OpPolicy>> = OnceLock::new();
        SHARED.get_or_init(|| Arc::new(OpPolicy::default())).clone()
    }

    /// A policy that serves nothing until rules allow it: no default
    /// families (`allow @arithmetic` brings one back).
    pub fn empty() -> OpPolicy {
        OpPolicy::with_defaults(false)
    }

    /// Whether the default families grant.
    pub fn serves_default_families(&self) -> bool {
        self.defaults
    }

    /// The rules, in the order they were added.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Adds a rule ([`Action`], `pattern`), noting where it was written.
    ///
    /// # Errors
    /// `ValueError` for a bad pattern ([`Pattern::parse`]).
    pub fn rule(mut self, action: Action, pattern: &str, origin: Option<String>) -> Result<Self> {
        let pattern = Pattern::parse(pattern).map_err(|e| match &origin {
            Some(o) => Error::value(format!("{o}: {}", e.message())),
            None => e,
        })?;
        self.rules.push(Rule {
            action,
            pattern,
            origin,
        });
        self.verdicts
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        Ok(self)
    }

    /// Serves the ops `pattern` matches (unless a deny rule matches them too).
    ///
    /// # Errors
    /// `ValueError` for a bad pattern ([`Pattern::parse`]).
    pub fn allow(self, pattern: &str) -> Result<Self> {
        self.rule(Action::Allow, pattern, None)
    }

    /// Refuses the ops `pattern` matches, whatever allows them.
    ///
    /// # Errors
    /// `ValueError` for a bad pattern ([`Pattern::parse`]).
    pub fn deny(self, pattern: &str) -> Result<Self> {
        self.rule(Action::Deny, pattern, None)
    }

    /// Adds the rules of a policy file's text, `source` naming it in errors
    /// and in each rule's origin: one rule a line, `allow PATTERN` or `deny
    /// PATTERN`; `#` starts a comment; blank lines are skipped.
    ///
    /// # Errors
    /// `ValueError` "SOURCE:LINE: ..." for a line that is not a rule or has
    /// a bad pattern.
    pub fn rules_from_text(mut self, text: &str, source: &str) -> Result<Self> {
        for (i, line) in text.lines().enumerate() {
            let at = format!("{source}:{}", i + 1);
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let action = match words.next() {
                Some("allow") => Action::Allow,
                Some("deny") => Action::Deny,
                _ => {
                    return Err(Error::value(format!(
                        "{at}: expected `allow PATTERN` or `deny PATTERN`, found `{line}`"
                    )));
                }
            };
            let (Some(pattern), None) = (words.next(), words.next()) else {
                return Err(Error::value(format!(
                    "{at}: expected one pattern after `{action}`, found `{line}`"
                )));
            };
            self = self.rule(action, pattern, Some(at))?;
        }
        Ok(self)
    }

    /// Adds the rules of the policy file at `path` ([`rules_from_text`](Self::rules_from_text)).
    ///
    /// # Errors
    /// `ValueError` for a bad line (with the file and line), `RuntimeError`
    /// if the file cannot be read.
    pub fn rules_from_file(self, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::runtime(format!(
                "cannot read op policy file {}: {e}",
                path.display()
            ))
        })?;
        self.rules_from_text(&text, &path.display().to_string())
    }

    /// The verdict on op `base` of `namespace` with these overload
    /// schemas (steps 1-4 of the module docs).
    fn decide(&self, namespace: &str, base: &str, schemas: &[String]) -> Verdict {
        let matching = |action: Action| {
            self.rules
                .iter()
                .filter(move |r| r.action == action && r.pattern.matches(namespace, base, action))
        };
        if let Some(rule) = matching(Action::Deny).next() {
            return Verdict::Denied(Denial::Rule(rule.clone()));
        }
        if let Some(rule) =
            matching(Action::Allow).find(|r| matches!(r.pattern, Pattern::Exact { .. }))
        {
            return Verdict::Allowed {
                by: Grant::Rule(rule.clone()),
                withheld: Vec::new(),
            };
        }
        let grant = matching(Action::Allow)
            .next()
            .map(|r| Grant::Rule(r.clone()))
            .or_else(|| {
                FAMILIES
                    .iter()
                    .find(|f| self.defaults && f.contains(namespace, base))
                    .map(Grant::Family)
            });
        let withheld: Vec<Overload> = schemas
            .iter()
            .filter_map(|s| Overload::withheld(s))
            .collect();
        let all_unsafe = !schemas.is_empty() && withheld.len() == schemas.len();
        match grant {
            Some(_) if all_unsafe => {
                Verdict::Denied(Denial::UnsafeSchema(withheld[0].hazard.clone()))
            }
            Some(by) => Verdict::Allowed { by, withheld },
            None if namespace != "aten" && namespace != "builtins" => {
                Verdict::Denied(Denial::OtherNamespace(namespace.to_owned()))
            }
            None if base.starts_with('_') => Verdict::Denied(Denial::Private),
            None if all_unsafe => Verdict::Denied(Denial::UnsafeSchema(withheld[0].hazard.clone())),
            None => Verdict::Denied(Denial::NotInFamily),
        }
    }

    /// The cached verdict on the op the registry calls `name` (POL-5).
    fn cached(&self, name: &str, schemas: &[String]) -> Arc<Verdict> {
        if let Some(v) = self
            .verdicts
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
        {
            return v.clone();
        }
        let (namespace, base) = split_registry_name(name);
        let verdict = Arc::new(self.decide(namespace, base, schemas));
        self.verdicts
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.to_owned())
            .or_insert(verdict)
            .clone()
    }

    /// The verdict on the op a caller names `name`, in any spelling
    /// (`aten::add`, `torch.ops.aten.add`, `add`, `aten::add.Tensor`: an
    /// overload names its op), and the op's registry name.
    ///
    /// # Errors
    /// [`OpError::UnknownOp`] if no op this host can call has that name.
    pub fn verdict_of(&self, name: &str) -> std::result::Result<(String, Arc<Verdict>), OpError> {
        if BUILTINS.contains(&name) {
            return Ok((name.to_owned(), self.cached(name, &[])));
        }
        let qualified = qualified_name(name);
        // `aten::add.Tensor` → `aten::add`: the registry resolves ops, and
        // the verdict covers every overload.
        let op_name = match qualified.split_once("::") {
            Some((ns, rest)) => format!("{ns}::{}", rest.split('.').next().unwrap_or(rest)),
            None => qualified.into_owned(),
        };
        let op = Operator::resolve(&op_name)?;
        Ok((op.name().to_owned(), self.cached(op.name(), op.schemas())))
    }

    /// The verdict on the op a caller names `name` ([`verdict_of`](Self::verdict_of)).
    ///
    /// # Errors
    /// [`OpError::UnknownOp`] if no op this host can call has that name.
    pub fn verdict(&self, name: &str) -> std::result::Result<Arc<Verdict>, OpError> {
        self.verdict_of(name).map(|(_, v)| v)
    }

    /// Whether `admission` may run on `worker` (POL-1, POL-4).
    ///
    /// # Errors
    /// The refusal (`RuntimeError` naming the op, the worker and how to
    /// allow it).
    pub fn admit(
        &self,
        admission: &Admission<'_>,
        worker: &str,
    ) -> std::result::Result<(), OpError> {
        let (name, schemas) = match admission.target {
            Target::Op(op) => (op.name(), op.schemas()),
            Target::Builtin(name) => (name, &[][..]),
        };
        let screen = |verdict: &Verdict| match verdict {
            Verdict::Denied(denial) => Err(refusal(worker, name, denial)),
            Verdict::Allowed { withheld, .. } => Ok(withheld
                .iter()
                .any(|o| o.could_bind(admission.args, admission.kwargs, admission.method))),
        };
        // The hot path decides under the read lock, without touching the
        // verdict's reference count (POL-5).
        let cached = self
            .verdicts
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .map(|v| screen(v));
        let needs_matching = match cached {
            Some(answer) => answer?,
            None => screen(&self.cached(name, schemas))?,
        };
        if !needs_matching {
            return Ok(());
        }
        let verdict = self.cached(name, schemas);
        let withheld = match &*verdict {
            Verdict::Allowed { withheld, .. } => withheld,
            Verdict::Denied(denial) => return Err(refusal(worker, name, denial)),
        };
        // A withheld overload fits the call's argument kinds: ask libtorch
        // which overload it binds. A call no overload accepts fails with
        // libtorch's own error when it is made; nothing runs.
        match admission.matching_schema() {
            Ok(Some(schema)) => match withheld.iter().find(|o| o.schema() == schema) {
                Some(overload) => Err(withheld_refusal(worker, name, overload)),
                None => Ok(()),
            },
            Ok(None) | Err(_) => Ok(()),
        }
    }

    /// Every op this host knows (libtorch's registry, and Python's builtins)
    /// with its verdict, sorted by name; an op that cannot be called by name
    /// (it needs a TorchScript graph) has its error instead.
    pub fn every_op(&self) -> Vec<(String, std::result::Result<Arc<Verdict>, OpError>)> {
        let mut names = wasmrpc_torch_sys::registered_ops();
        names.extend(BUILTINS.iter().map(|b| (*b).to_owned()));
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|name| {
                let verdict = if BUILTINS.contains(&name.as_str()) {
                    Ok(self.cached(&name, &[]))
                } else {
                    Operator::resolve(&name).map(|op| self.cached(op.name(), op.schemas()))
                };
                (name, verdict)
            })
            .collect()
    }
}

/// `aten::add` → (`aten`, `add`); `builtins.min` → (`builtins`, `min`).
fn split_registry_name(name: &str) -> (&str, &str) {
    if let Some(base) = name.strip_prefix("builtins.") {
        return ("builtins", base);
    }
    name.split_once("::").unwrap_or(("", name))
}

/// The [`OpGate`] of one worker's callers: its [`OpPolicy`], naming the
/// worker in refusals (POL-1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PolicyGate<'a> {
    /// The worker's policy.
    pub(crate) policy: &'a OpPolicy,
    /// The worker's name, for refusals.
    pub(crate) worker: &'a str,
}

impl OpGate for PolicyGate<'_> {
    fn admit(&self, admission: &Admission<'_>) -> std::result::Result<(), OpError> {
        self.policy.admit(admission, self.worker)
    }
}

#[cfg(test)]
mod tests;
