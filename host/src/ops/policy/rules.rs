//! A policy's rules: [`Rule`]s of an [`Action`] on a [`Pattern`] (an op
//! name, a glob, or a family), and how patterns match op names.

use std::fmt;

use wasmrpc_torch_sys::qualified_name;

use super::{FAMILIES, Family, family};
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
