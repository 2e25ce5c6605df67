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

/// What a rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Serve the ops it matches.
    Allow,
    /// Refuse the ops it matches; wins over every allow.
    Deny,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
        })
    }
}

/// What a rule matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    /// One op: `aten::from_file`.
    Exact {
        /// Its namespace (`aten`, `prim`, `builtins`).
        namespace: String,
        /// Its name in the namespace.
        base: String,
    },
    /// Ops by glob, `*` matching any run of characters.
    Glob {
        /// The namespace's glob.
        namespace: String,
        /// The name's glob.
        base: String,
    },
    /// Every member of a family: `@random`.
    Family(&'static Family),
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Exact { namespace, base } | Pattern::Glob { namespace, base } => {
                if namespace == "builtins" {
                    write!(f, "builtins.{base}")
                } else {
                    write!(f, "{namespace}::{base}")
                }
            }
            Pattern::Family(family) => write!(f, "@{}", family.name),
        }
    }
}

/// `*` globbing: `*` matches any run of characters, everything else itself.
pub(crate) fn glob_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// Whether a glob part may match `text` in an allow rule: `*` does not
/// match a leading `_` unless the glob starts with one itself.
fn allow_may_match(glob: &str, text: &str) -> bool {
    !text.starts_with('_') || glob.starts_with('_')
}

impl Pattern {
    /// Parses a pattern as rules and flags write it (see the module docs).
    ///
    /// # Errors
    /// `ValueError` for an empty pattern, an unknown family, a name with an
    /// overload, or characters no op name has.
    pub fn parse(text: &str) -> Result<Pattern> {
        let text = text.trim();
        if text.is_empty() {
            return Err(Error::value("an op pattern is empty"));
        }
        if let Some(name) = text.strip_prefix('@') {
            return family(name).map(Pattern::Family).ok_or_else(|| {
                let known: Vec<String> = FAMILIES.iter().map(|f| format!("@{}", f.name)).collect();
                Error::value(format!(
                    "unknown op family @{name} (the families are {})",
                    known.join(", ")
                ))
            });
        }
        let (namespace, base) = if text == "*" {
            ("*".to_owned(), "*".to_owned())
        } else if let Some(base) = text.strip_prefix("builtins.") {
            ("builtins".to_owned(), base.to_owned())
        } else {
            let qualified = qualified_name(text);
            let Some((namespace, base)) = qualified.split_once("::") else {
                return Err(Error::value(format!("bad op pattern {text:?}")));
            };
            (namespace.to_owned(), base.to_owned())
        };
        if let Some((op, overload)) = base.split_once('.') {
            return Err(Error::value(format!(
                "op pattern {text:?} names overload `{overload}` of {namespace}::{op}: rules \
                 name ops, with every overload (write {namespace}::{op})"
            )));
        }
        let valid = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'*')
        };
        if !valid(&namespace) || !valid(&base) {
            return Err(Error::value(format!(
                "bad op pattern {text:?}: expected NAMESPACE::NAME (letters, digits, `_`, `*`), \
                 a bare NAME (an aten op), builtins.NAME, or @FAMILY"
            )));
        }
        Ok(if namespace.contains('*') || base.contains('*') {
            Pattern::Glob { namespace, base }
        } else {
            Pattern::Exact { namespace, base }
        })
    }

    /// Whether the pattern matches op `base` of `namespace`, for a rule
    /// doing `action`.
    pub fn matches(&self, namespace: &str, base: &str, action: Action) -> bool {
        match self {
            Pattern::Exact {
                namespace: ns,
                base: b,
            } => ns == namespace && b == base,
            Pattern::Glob {
                namespace: ns,
                base: b,
            } => {
                glob_match(ns, namespace)
                    && glob_match(b, base)
                    && (action == Action::Deny
                        || allow_may_match(ns, namespace) && allow_may_match(b, base))
            }
            Pattern::Family(family) => family.contains(namespace, base),
        }
    }
}

/// One rule of a policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Allow or deny.
    pub action: Action,
    /// What it matches.
    pub pattern: Pattern,
    /// Where it was written (`policy.txt:3`, `--deny-op`), if not in Rust.
    pub origin: Option<String>,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.action, self.pattern)?;
        if let Some(origin) = &self.origin {
            write!(f, " ({origin})")?;
        }
        Ok(())
    }
}

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
mod tests {
    //! POLICY_TEST_NAMES_DENIED_OPS: op names in this file are inputs the
    //! policy must refuse, not ops the seeds call (see
    //! `every_op_the_seeds_call_is_allowed_by_default`).

    use super::*;
    use crate::ops::schema::{HazardKind, schema_hazard};
    use std::collections::{BTreeMap, BTreeSet};
    use wasmrpc_torch_sys::{OpValue, call_op, registered_ops};

    fn schemas(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    const ADD: &[&str] = &[
        "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor",
        "aten::add.t(t[] a, t[] b) -> t[]",
    ];
    const FROM_FILE: &[&str] =
        &["aten::from_file(str filename, bool? shared=None, int? size=0) -> Tensor"];

    fn denial(v: &Verdict) -> &Denial {
        match v {
            Verdict::Denied(d) => d,
            Verdict::Allowed { by, .. } => panic!("allowed by {by}"),
        }
    }

    #[test]
    fn rules_decide_in_order_deny_then_exact_allow_then_globs_and_families() {
        let default = OpPolicy::default();
        match default.decide("aten", "add", &schemas(ADD)) {
            Verdict::Allowed {
                by: Grant::Family(f),
                withheld,
            } => {
                assert_eq!(f.name, "arithmetic");
                assert_eq!(withheld.len(), 1);
                assert_eq!(withheld[0].schema(), ADD[1]);
                assert_eq!(withheld[0].hazard.kind, HazardKind::Opaque);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            denial(&default.decide("aten", "from_file", &schemas(FROM_FILE))),
            Denial::UnsafeSchema(h) if h.kind == HazardKind::FileName
        ));
        assert!(matches!(
            denial(&default.decide("prim", "dtype", &schemas(&["prim::dtype(Tensor a) -> int"]))),
            Denial::OtherNamespace(ns) if ns == "prim"
        ));
        assert!(matches!(
            denial(&default.decide(
                "aten",
                "_foo",
                &schemas(&["aten::_foo(Tensor a) -> Tensor"])
            )),
            Denial::Private
        ));
        assert!(matches!(
            denial(&default.decide(
                "aten",
                "empty",
                &schemas(&["aten::empty(int[] size) -> Tensor"])
            )),
            Denial::NotInFamily
        ));

        // An exact allow grants every overload, hazards included; deny wins.
        let p = OpPolicy::default()
            .allow("aten::from_file")
            .unwrap()
            .allow("aten::add")
            .unwrap();
        assert!(
            p.decide("aten", "from_file", &schemas(FROM_FILE))
                .is_allowed()
        );
        match p.decide("aten", "add", &schemas(ADD)) {
            Verdict::Allowed {
                by: Grant::Rule(r),
                withheld,
            } => {
                assert_eq!(r.to_string(), "allow aten::add");
                assert!(withheld.is_empty());
            }
            other => panic!("{other:?}"),
        }
        let p = p.deny("aten::from_file").unwrap();
        assert!(matches!(
            denial(&p.decide("aten", "from_file", &schemas(FROM_FILE))),
            Denial::Rule(r) if r.to_string() == "deny aten::from_file"
        ));

        // Globs and families grant safe overloads only.
        let p = OpPolicy::empty().allow("aten::*").unwrap();
        assert!(matches!(
            denial(&p.decide("aten", "from_file", &schemas(FROM_FILE))),
            Denial::UnsafeSchema(_)
        ));
        assert!(matches!(
            p.decide("aten", "add", &schemas(ADD)),
            Verdict::Allowed { withheld, .. } if withheld.len() == 1
        ));
        assert!(
            p.decide(
                "aten",
                "empty",
                &schemas(&["aten::empty(int[] size) -> Tensor"])
            )
            .is_allowed()
        );

        // Families can be denied as a whole; an empty policy serves nothing.
        let p = OpPolicy::default().deny("@arithmetic").unwrap();
        assert!(matches!(
            denial(&p.decide("aten", "add_", &schemas(ADD))),
            Denial::Rule(_)
        ));
        assert!(p.decide("aten", "matmul", &[]).is_allowed());
        assert!(matches!(
            denial(&OpPolicy::empty().decide("aten", "add", &schemas(ADD))),
            Denial::NotInFamily
        ));
        let p = OpPolicy::empty().allow("@arithmetic").unwrap();
        assert!(p.decide("aten", "add", &schemas(ADD)).is_allowed());
        assert!(!p.decide("aten", "matmul", &[]).is_allowed());
    }

    #[test]
    fn allow_globs_skip_private_names_and_deny_globs_do_not() {
        let p = OpPolicy::empty().allow("*").unwrap();
        assert!(p.decide("aten", "add", &[]).is_allowed());
        assert!(p.decide("prim", "dtype", &[]).is_allowed());
        assert!(!p.decide("aten", "_foo", &[]).is_allowed());
        assert!(!p.decide("_caffe2", "x", &[]).is_allowed());
        let p = OpPolicy::empty().allow("aten::_*").unwrap();
        assert!(p.decide("aten", "_foo", &[]).is_allowed());
        let p = OpPolicy::default()
            .allow("*")
            .unwrap()
            .deny("aten::*")
            .unwrap();
        assert!(!p.decide("aten", "_foo", &[]).is_allowed());
        assert!(!p.decide("aten", "add", &[]).is_allowed());
        assert!(p.decide("prim", "dtype", &[]).is_allowed());
    }

    #[test]
    fn patterns_take_every_spelling_and_refuse_overloads_and_unknown_families() {
        let exact = |ns: &str, base: &str| Pattern::Exact {
            namespace: ns.into(),
            base: base.into(),
        };
        assert_eq!(
            Pattern::parse("aten::from_file").unwrap(),
            exact("aten", "from_file")
        );
        assert_eq!(
            Pattern::parse("torch.ops.aten.from_file").unwrap(),
            exact("aten", "from_file")
        );
        assert_eq!(
            Pattern::parse(" from_file ").unwrap(),
            exact("aten", "from_file")
        );
        assert_eq!(
            Pattern::parse("builtins.min").unwrap(),
            exact("builtins", "min")
        );
        assert!(matches!(
            Pattern::parse("prim::*").unwrap(),
            Pattern::Glob { .. }
        ));
        assert!(matches!(Pattern::parse("*").unwrap(), Pattern::Glob { .. }));
        assert_eq!(Pattern::parse("@random").unwrap().to_string(), "@random");
        let e = Pattern::parse("aten::add.Tensor").unwrap_err();
        assert!(
            e.message().contains("names overload `Tensor` of aten::add"),
            "{e}"
        );
        let e = Pattern::parse("@nope").unwrap_err();
        assert!(e.message().contains("unknown op family @nope"), "{e}");
        assert!(e.message().contains("@arithmetic"), "{e}");
        for bad in ["", "aten::", "a b", "aten::x;y", "::x"] {
            assert!(Pattern::parse(bad).is_err(), "{bad:?} parsed");
        }
        assert!(glob_match("linalg_*", "linalg_inv"));
        assert!(glob_match("*_backward", "mse_loss_backward"));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(!glob_match("linalg_*", "matmul"));
        assert!(glob_match("*", ""));
    }

    #[test]
    fn policy_files_take_comments_and_name_the_line_of_a_bad_rule() {
        let text = "# trusted plugins read their data\nallow aten::from_file  # the loader\n\n  deny @random\n";
        let p = OpPolicy::default()
            .rules_from_text(text, "ops.policy")
            .unwrap();
        let rules: Vec<String> = p.rules().iter().map(ToString::to_string).collect();
        assert_eq!(
            rules,
            [
                "allow aten::from_file (ops.policy:2)",
                "deny @random (ops.policy:4)"
            ]
        );
        let e = OpPolicy::default()
            .rules_from_text("allow aten::add\npermit aten::mul\n", "p.txt")
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ValueError);
        assert!(
            e.message()
                .starts_with("p.txt:2: expected `allow PATTERN` or `deny PATTERN`"),
            "{e}"
        );
        let e = OpPolicy::default()
            .rules_from_text("deny @nope", "p.txt")
            .unwrap_err();
        assert!(
            e.message().starts_with("p.txt:1: unknown op family @nope"),
            "{e}"
        );
        let e = OpPolicy::default()
            .rules_from_text("allow a b", "p.txt")
            .unwrap_err();
        assert!(
            e.message().starts_with("p.txt:1: expected one pattern"),
            "{e}"
        );
        let e = OpPolicy::default()
            .rules_from_file("/nonexistent/ops.policy")
            .unwrap_err();
        assert!(
            e.message()
                .contains("cannot read op policy file /nonexistent/ops.policy"),
            "{e}"
        );
    }

    #[test]
    fn every_spelling_of_a_name_gets_the_op_verdict() {
        let p = OpPolicy::default();
        for name in [
            "aten::add",
            "torch.ops.aten.add",
            "add",
            "aten::add.Tensor",
            "torch.ops.aten.add.Scalar",
        ] {
            let (op, v) = p.verdict_of(name).unwrap();
            assert_eq!(op, "aten::add", "{name}");
            assert!(v.is_allowed(), "{name}");
        }
        for name in [
            "aten::from_file",
            "torch.ops.aten.from_file",
            "from_file",
            "aten::from_file.out",
        ] {
            let (op, v) = p.verdict_of(name).unwrap();
            assert_eq!(op, "aten::from_file", "{name}");
            assert!(!v.is_allowed(), "{name}");
        }
        assert!(p.verdict("builtins.min").unwrap().is_allowed());
        assert!(matches!(
            p.verdict("aten::no_such_op"),
            Err(OpError::UnknownOp { .. })
        ));
        assert!(matches!(
            p.verdict("builtins.eval"),
            Err(OpError::UnknownOp { .. })
        ));
    }

    #[test]
    fn refusals_name_the_worker_the_op_and_how_to_allow_it() {
        let p = OpPolicy::default();
        let op = Operator::resolve("aten::from_file").unwrap();
        let args = [OpValue::Str("/etc/hostname".into())];
        let admission = Admission {
            target: Target::Op(&op),
            args: &args,
            kwargs: &[],
            method: false,
        };
        let e = p.admit(&admission, "worker1").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RuntimeError);
        let text = e.to_string();
        assert!(
            text.starts_with("worker1 does not run aten::from_file: the op takes a file name"),
            "{text}"
        );
        assert!(
            text.ends_with("(allow it with --allow-op aten::from_file, or OpPolicy::allow in RpcBackendOptions::op_policy)"),
            "{text}"
        );
        let e = p.clone().deny("aten::add").unwrap();
        let add = Operator::resolve("aten::add").unwrap();
        let refused = e
            .admit(
                &Admission {
                    target: Target::Op(&add),
                    args: &[],
                    kwargs: &[],
                    method: false,
                },
                "w",
            )
            .unwrap_err()
            .to_string();
        assert_eq!(
            refused,
            "w does not run aten::add: denied by rule `deny aten::add` (remove that rule to serve it)"
        );
    }

    #[test]
    fn withheld_overloads_are_refused_and_the_rest_of_the_op_runs() {
        let policy = OpPolicy::default();
        let gate = PolicyGate {
            policy: &policy,
            worker: "worker1",
        };
        let t = || OpValue::Tensor(tch::Tensor::ones([2], (tch::Kind::Float, tch::Device::Cpu)));
        // Tensors: `add.Tensor`, no matching needed.
        let out = wasmrpc_torch_sys::call_op_gated("aten::add", &[t(), t()], &[], &gate).unwrap();
        assert_eq!(out.len(), 1);
        // Ints: `add.int`, after asking libtorch (a list overload could fit).
        let out = wasmrpc_torch_sys::call_op_gated(
            "aten::add",
            &[OpValue::Int(2), OpValue::Int(3)],
            &[],
            &gate,
        )
        .unwrap();
        assert!(matches!(out[..], [OpValue::Int(5)]));
        // Lists bind `add.t(t[] a, t[] b)`: withheld.
        let lists = [OpValue::List(vec![]), OpValue::List(vec![])];
        let e = wasmrpc_torch_sys::call_op_gated("aten::add", &lists, &[], &gate).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("worker1 does not run aten::add.t(t[] a, t[] b) -> t[]"),
            "{e}"
        );
        // `mul.left_t(t[] l, int n)` would build a list of n items.
        let e = wasmrpc_torch_sys::call_op_gated(
            "aten::mul",
            &[OpValue::List(vec![]), OpValue::Int(1 << 40)],
            &[],
            &gate,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("does not run aten::mul.left_t"),
            "{e}"
        );
        // A generator the caller passes, even None, is the withheld
        // `rand.generator`; without one, the worker's own generator runs.
        let size = || OpValue::List(vec![OpValue::Int(2)]);
        let e = wasmrpc_torch_sys::call_op_gated(
            "aten::rand",
            &[size()],
            &[("generator".into(), OpValue::None)],
            &gate,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("does not run aten::rand.generator"),
            "{e}"
        );
        assert!(wasmrpc_torch_sys::call_op_gated("aten::rand", &[size()], &[], &gate).is_ok());
    }

    /// Our values cannot be generators: no `OpValue` variant is one (this
    /// match has no wildcard, so adding a variant fails to compile here
    /// until it is reviewed), and no value of any variant converts to a
    /// `Generator` parameter.
    #[test]
    fn callers_cannot_pass_a_generator() {
        let t = tch::Tensor::ones([1], (tch::Kind::Float, tch::Device::Cpu));
        let every_kind = [
            OpValue::None,
            OpValue::Bool(true),
            OpValue::Int(7),
            OpValue::Float(0.5),
            OpValue::Str("cpu".into()),
            OpValue::Tensor(t),
            OpValue::List(vec![OpValue::Int(7)]),
            OpValue::Tuple(vec![OpValue::Int(7)]),
            OpValue::Dtype(tch::Kind::Float),
            OpValue::Device(tch::Device::Cpu),
        ];
        for value in every_kind {
            let could_be_a_generator = match &value {
                OpValue::None => true,
                OpValue::Bool(_)
                | OpValue::Int(_)
                | OpValue::Float(_)
                | OpValue::Str(_)
                | OpValue::Tensor(_)
                | OpValue::List(_)
                | OpValue::Tuple(_)
                | OpValue::Dtype(_)
                | OpValue::Device(_) => false,
            };
            // `aten::initial_seed(Generator self)`: only a real generator fits.
            let r = call_op("aten::initial_seed", &[value.shallow_clone()], &[]);
            assert!(
                matches!(r, Err(OpError::NoMatchingSchema { .. })),
                "{value:?}: {r:?}"
            );
            // `rand.generator(..., Generator? generator)`: None, the default one.
            let rand = Operator::resolve("aten::rand").unwrap();
            let r = rand.matching_schema(
                &[OpValue::List(vec![OpValue::Int(2)])],
                &[("generator".into(), value.shallow_clone())],
            );
            assert_eq!(r.is_ok(), could_be_a_generator, "{value:?}: {r:?}");
        }
    }

    /// Counts this thread's heap allocations, for POL-5.
    struct CountingAllocator;

    thread_local! {
        static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    // SAFETY: every call forwards to the system allocator unchanged; the
    // counter is a const-initialized thread-local without a destructor, so
    // touching it allocates nothing.
    unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
        unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
            // SAFETY: the caller's contract, forwarded.
            unsafe { std::alloc::System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
            // SAFETY: the caller's contract, forwarded.
            unsafe { std::alloc::System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
            // SAFETY: the caller's contract, forwarded.
            unsafe { std::alloc::System.realloc(ptr, layout, size) }
        }
    }

    #[global_allocator]
    static COUNTING: CountingAllocator = CountingAllocator;

    /// POL-5: once an op's verdict is cached, admitting a call to it
    /// allocates nothing (the hot path: `aten::add` of two tensors from a
    /// peer, a withheld overload in the op screened out by argument kinds).
    #[test]
    fn a_cached_verdict_admits_without_allocating() {
        let policy = OpPolicy::default();
        let add = Operator::resolve("aten::add").unwrap();
        let t = || {
            OpValue::Tensor(tch::Tensor::ones(
                [2, 2],
                (tch::Kind::Float, tch::Device::Cpu),
            ))
        };
        let args = [t(), t()];
        let admission = Admission {
            target: Target::Op(&add),
            args: &args,
            kwargs: &[],
            method: false,
        };
        policy.admit(&admission, "worker1").unwrap();
        let before = ALLOCATIONS.with(std::cell::Cell::get);
        let started = std::time::Instant::now();
        for _ in 0..10_000 {
            policy.admit(&admission, "worker1").unwrap();
        }
        let per_call = started.elapsed() / 10_000;
        let allocated = ALLOCATIONS.with(std::cell::Cell::get) - before;
        println!(
            "admitting aten::add from the cache: {per_call:?} a call, {allocated} allocations"
        );
        assert_eq!(allocated, 0);
    }

    /// A second reading of the schema rules (POL-3), written apart from
    /// `schema.rs`, for the registry walk: the parameter declarations of one
    /// overload that the issue names as unsafe.
    fn independent_hazards(schema: &str) -> Vec<String> {
        let Some(params) = crate::ops::schema::parse_params(schema) else {
            return vec![format!("unreadable: {schema}")];
        };
        let mut found = Vec::new();
        for p in params {
            let ty = p.ty.replace("(a!)", "").replace("(a)", "");
            let plain = ty.trim_end_matches('?').trim_end_matches("[]");
            let unsafe_type = ty.contains("Storage")
                || ty.contains("Stream")
                || (ty.contains("Generator")
                    && !(ty == "Generator?" && p.default.as_deref() == Some("None")))
                || ty.contains("Any")
                || ty.contains("Capsule")
                || ty.contains("__torch__")
                || ty.contains("Future")
                || ty.contains("RRef")
                || ty.contains("Dict")
                || ty == "..."
                || plain == "t"
                || plain.starts_with("t[")
                || plain == "tVal"
                || plain == "t1"
                || plain == "t2";
            let pointer = ty.starts_with("int")
                && ["ptr", "data_ptr", "address", "addr", "pointer"]
                    .iter()
                    .any(|n| p.name == *n || p.name.ends_with(&format!("_{n}")));
            let file = ty.starts_with("str")
                && ["filename", "path", "file", "f"].contains(&p.name.as_str());
            if unsafe_type || pointer || file {
                found.push(format!("{} {}", p.ty, p.name));
            }
        }
        found
    }

    /// Overloads of default-family ops that the policy withholds, reviewed:
    /// TorchScript's list builtins (`t[]`), dict views and enum comparisons,
    /// and the random ops' overloads taking a generator argument. A new
    /// entry means libtorch grew an unsafe overload on a family member (or
    /// a member was added): review it, then list it here.
    const REVIEWED_WITHHELD: &[&str] = &[
        "aten::add.t",
        "aten::add_.t",
        "aten::eq.enum",
        "aten::mul.left_t",
        "aten::mul.right_",
        "aten::mul_.t",
        "aten::ne.enum",
        "aten::rand.generator",
        "aten::rand.generator_out",
        "aten::rand_like.generator",
        "aten::rand_like.generator_out",
        "aten::randint.generator",
        "aten::randint.generator_out",
        "aten::randint.low_generator",
        "aten::randint.low_generator_out",
        "aten::randint_like.Tensor_generator",
        "aten::randint_like.Tensor_generator_out",
        "aten::randint_like.generator",
        "aten::randint_like.generator_out",
        "aten::randint_like.low_generator_dtype",
        "aten::randint_like.low_generator_dtype_out",
        "aten::randn.generator",
        "aten::randn.generator_out",
        "aten::randn_like.generator",
        "aten::randn_like.generator_out",
        "aten::randperm.generator",
        "aten::randperm.generator_out",
        "aten::select.t",
        "aten::slice.t",
        "aten::sort.any",
        "aten::values.Tensor",
        "aten::values.bool",
        "aten::values.complex",
        "aten::values.float",
        "aten::values.int",
        "aten::values.str",
    ];

    /// The walk the issue asks for: every operator libtorch registers, and
    /// for each the default policy serves, every overload's schema.
    #[test]
    fn the_registry_walk_finds_no_unsafe_overload_a_caller_can_reach() {
        let policy = OpPolicy::default();
        let registered: BTreeSet<String> = registered_ops().into_iter().collect();
        assert!(
            registered.len() > 1000,
            "the registry lists {} ops",
            registered.len()
        );

        // No dead names: every family member is registered and callable.
        let mut dead = Vec::new();
        for family in FAMILIES.iter().filter(|f| f.namespace == "aten") {
            for name in family.member_names() {
                if !registered.contains(&name) || Operator::resolve(&name).is_err() {
                    dead.push(format!("@{}: {name}", family.name));
                }
            }
        }
        assert!(
            dead.is_empty(),
            "family members libtorch cannot call by name:\n{}",
            dead.join("\n")
        );

        let (mut callable, mut allowed) = (0, 0);
        let mut withheld_seen = BTreeSet::new();
        let mut reachable_hazards = Vec::new();
        let mut denied: BTreeMap<&str, usize> = BTreeMap::new();
        let mut hazards: BTreeMap<String, usize> = BTreeMap::new();
        for (name, verdict) in policy.every_op() {
            let Ok(verdict) = verdict else { continue };
            if BUILTINS.contains(&name.as_str()) {
                assert!(verdict.is_allowed(), "{name}");
                continue;
            }
            callable += 1;
            let op = Operator::resolve(&name).unwrap();
            for schema in op.schemas() {
                if let Some(h) = schema_hazard(schema) {
                    *hazards.entry(format!("{:?}", h.kind)).or_default() += 1;
                }
            }
            match &*verdict {
                Verdict::Denied(d) => {
                    *denied
                        .entry(match d {
                            Denial::Rule(_) => "deny rule",
                            Denial::OtherNamespace(_) => "other namespace",
                            Denial::Private => "private",
                            Denial::UnsafeSchema(_) => "unsafe schema",
                            Denial::NotInFamily => "not in a family",
                        })
                        .or_default() += 1;
                }
                Verdict::Allowed { withheld, .. } => {
                    allowed += 1;
                    assert_eq!(name.split("::").next(), Some("aten"), "{name} is allowed");
                    for schema in op.schemas() {
                        let held = withheld.iter().any(|o| o.schema() == schema);
                        let overload = schema.split('(').next().unwrap_or(schema).to_owned();
                        if held {
                            withheld_seen.insert(overload);
                            continue;
                        }
                        let independent = independent_hazards(schema);
                        if !independent.is_empty() || schema_hazard(schema).is_some() {
                            reachable_hazards
                                .push(format!("{schema}\n    unsafe: {independent:?}"));
                        }
                    }
                }
            }
        }
        println!(
            "registry walk: {} ops registered, {callable} callable by name, {allowed} allowed by \
             default, {} overloads withheld; denied: {denied:?}; overloads with hazards, all ops: \
             {hazards:?}",
            registered.len(),
            withheld_seen.len()
        );
        assert!(
            reachable_hazards.is_empty(),
            "overloads of allowed ops that callers can reach have unsafe schemas:\n{}",
            reachable_hazards.join("\n")
        );
        let reviewed: BTreeSet<String> =
            REVIEWED_WITHHELD.iter().map(|s| (*s).to_owned()).collect();
        let new: Vec<&String> = withheld_seen.difference(&reviewed).collect();
        let gone: Vec<&String> = reviewed.difference(&withheld_seen).collect();
        assert!(
            new.is_empty() && gone.is_empty(),
            "withheld overloads changed: new (review, then list) {new:?}; no longer withheld {gone:?}"
        );
    }

    /// Files the scan below skips: they name ops the policy must refuse.
    const MARKER: &str = concat!("POLICY_TEST_NAMES", "_DENIED_OPS");

    /// Op names in string literals (`"aten::add"`, `"aten::sum.dim_IntList"`,
    /// `"torch.ops.aten.add"`) and tensor method names passed to RRef
    /// proxies (`.call("view", ...)`, `.call::<T>("size", ...)`).
    fn op_names_in(text: &str, names: &mut BTreeSet<String>, methods: &mut BTreeSet<String>) {
        let ident = |s: &str| -> String {
            s.chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        };
        for prefix in ["\"aten::", "\"torch.ops.aten."] {
            for (at, _) in text.match_indices(prefix) {
                let name = ident(&text[at + prefix.len()..]);
                if !name.is_empty() {
                    names.insert(format!("aten::{name}"));
                }
            }
        }
        for (at, _) in text.match_indices("(\"") {
            let before = text[..at].trim_end();
            let before = match before.rfind("::<") {
                Some(i) if before.ends_with('>') => &before[..i],
                _ => before,
            };
            if [".call", ".call_async", ".call_remote"]
                .iter()
                .any(|c| before.ends_with(c))
            {
                let name = ident(&text[at + 2..]);
                if text[at + 2 + name.len()..].starts_with('"') && !name.is_empty() {
                    methods.insert(name);
                }
            }
        }
    }

    fn scan(dir: &Path, names: &mut BTreeSet<String>, methods: &mut BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "target") {
                    scan(&path, names, methods);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                if !text.contains(MARKER) {
                    // Code, not comments: docs may name ops a policy must
                    // be told to allow.
                    let code: Vec<&str> = text
                        .lines()
                        .filter(|l| !l.trim_start().starts_with("//"))
                        .collect();
                    op_names_in(&code.join("\n"), names, methods);
                }
            }
        }
    }

    /// Every op the repository's own code calls by name (the seed ports,
    /// plugins, examples, benchmarks, the host, the guest SDK) is served by
    /// the default policy; so are the tensor methods it calls through RRef
    /// proxies. The seed tests themselves run under the default policy too.
    #[test]
    fn every_op_the_seeds_call_is_allowed_by_default() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let (mut names, mut methods) = (BTreeSet::new(), BTreeSet::new());
        for dir in [
            "tests",
            "plugins",
            "examples",
            "bench",
            "host/src",
            "guest-sdk/src",
        ] {
            scan(&root.join(dir), &mut names, &mut methods);
        }
        assert!(
            names.contains("aten::add") && names.contains("aten::linalg_multi_dot"),
            "{names:?}"
        );
        assert!(
            methods.contains("view") && methods.contains("size"),
            "{methods:?}"
        );
        let policy = OpPolicy::default();
        let mut refused = Vec::new();
        let mut unknown = Vec::new();
        for name in names.iter().chain(methods.iter()) {
            match policy.verdict_of(name) {
                Ok((op, v)) if !v.is_allowed() => refused.push(format!("{name} ({op}): {v:?}")),
                Ok(_) => {}
                Err(_) => unknown.push(name.as_str()),
            }
        }
        println!(
            "ops the repository calls: {names:?}; tensor methods: {methods:?}; not ops: {unknown:?}"
        );
        assert!(
            refused.is_empty(),
            "the default policy refuses ops the code calls:\n{}",
            refused.join("\n")
        );
        for builtin in BUILTINS {
            assert!(policy.verdict(builtin).unwrap().is_allowed());
        }
    }
}
