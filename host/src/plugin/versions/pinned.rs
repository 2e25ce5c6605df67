//! Pinned names, `namespace@<sha256 prefix>::function`: a call that names
//! one version of a plugin (see the parent module's docs). The agent asks
//! [`PinnedNames`] for names nobody registered; the version is chosen when
//! the call starts, among every version the worker holds, staged ones
//! included.

use std::sync::Arc;

use super::{MIN_PREFIX, SHORT, Versions};
use crate::agent::{CallContext, FunctionResolver, RpcFunction};
use crate::error::{Error, Result};
use crate::plugin::deploy::hex;
use crate::value::{Args, Payload};

impl Versions {
    /// The function `function` of the version of `namespace` whose sha256
    /// starts with `prefix`.
    fn pinned_function(
        &self,
        worker: &str,
        namespace: &str,
        prefix: &str,
        function: &str,
    ) -> Result<Arc<dyn RpcFunction>> {
        let pinned = format!("{namespace}@{prefix}::{function}");
        let prefix = prefix.to_ascii_lowercase();
        if prefix.len() < MIN_PREFIX || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::value(format!(
                "{pinned}: a version of a plugin is pinned by at least {MIN_PREFIX} hex digits \
                 of its sha256 (`{namespace}@<sha256 prefix>::{function}`), not `{prefix}`"
            )));
        }
        let groups = self.lock();
        let Some(group) = groups.get(namespace) else {
            return Err(Error::runtime(format!(
                "unknown function {pinned} on worker {worker}: it holds no versions of plugin \
                 {namespace}"
            )));
        };
        let version = by_prefix(
            group.versions.iter(),
            |v| hex(&v.sha256()),
            &prefix,
            || group.describe_held(),
        )
        .map_err(|e| e.pinned(&pinned, namespace, worker, &prefix))?;
        let name = format!("{namespace}::{function}");
        version.functions.get(&name).cloned().ok_or_else(|| {
            Error::runtime(format!(
                "unknown function {pinned} on worker {worker}: version {} of plugin {namespace} \
                 does not serve {function}",
                &hex(&version.sha256())[..SHORT]
            ))
        })
    }
}

/// Serves pinned names, `namespace@<sha256 prefix>::function` (asked by the
/// agent after its registry).
pub(crate) struct PinnedNames;

/// `(namespace, prefix, function)` of a pinned name.
fn parse_pinned(name: &str) -> Option<(&str, &str, &str)> {
    let (left, function) = name.split_once("::")?;
    let (namespace, prefix) = left.split_once('@')?;
    (!namespace.is_empty() && !function.is_empty()).then_some((namespace, prefix, function))
}

impl FunctionResolver for PinnedNames {
    fn resolve(&self, name: &str) -> Option<Arc<dyn RpcFunction>> {
        let (namespace, prefix, function) = parse_pinned(name)?;
        Some(Arc::new(PinnedFunction {
            namespace: namespace.to_owned(),
            prefix: prefix.to_owned(),
            function: function.to_owned(),
        }))
    }
}

struct PinnedFunction {
    namespace: String,
    prefix: String,
    function: String,
}

#[async_trait::async_trait]
impl RpcFunction for PinnedFunction {
    async fn call(&self, ctx: CallContext, args: Args) -> Result<Payload> {
        let agent = ctx.agent();
        let f = agent.state::<Versions>().pinned_function(
            agent.name(),
            &self.namespace,
            &self.prefix,
            &self.function,
        )?;
        f.call(ctx, args).await
    }
}

/// Why no single version answers a sha256 prefix.
#[derive(Debug, PartialEq)]
enum PrefixMiss {
    /// None matches; what the worker holds.
    None(String),
    /// Several match: their sha256s.
    Ambiguous(Vec<String>),
}

impl PrefixMiss {
    /// The error of a call to `pinned` (`namespace@prefix::function`).
    fn pinned(self, pinned: &str, namespace: &str, worker: &str, prefix: &str) -> Error {
        match self {
            PrefixMiss::None(held) => Error::runtime(format!(
                "unknown function {pinned} on worker {worker}: no version of plugin {namespace} \
                 has a sha256 starting with {prefix}; it holds {held}"
            )),
            PrefixMiss::Ambiguous(candidates) => Error::value(format!(
                "{pinned}: version prefix {prefix} of plugin {namespace} is ambiguous on worker \
                 {worker}: it matches {}; give more digits",
                candidates.join(", ")
            )),
        }
    }
}

/// The one version whose sha256 (`sha`, in hex) starts with `prefix`;
/// `held` describes them all for the error when none does.
fn by_prefix<'a, T>(
    versions: impl Iterator<Item = &'a T>,
    sha: impl Fn(&T) -> String,
    prefix: &str,
    held: impl FnOnce() -> String,
) -> std::result::Result<&'a T, PrefixMiss> {
    let matching: Vec<&T> = versions.filter(|v| sha(v).starts_with(prefix)).collect();
    match matching.as_slice() {
        [one] => Ok(*one),
        [] => Err(PrefixMiss::None(held())),
        many => Err(PrefixMiss::Ambiguous(many.iter().map(|v| sha(v)).collect())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_picks_one_version_or_says_why_not() {
        // Two sha256s sharing their first 8 hex digits cannot be made from
        // plugins in a test's time (2^16 tries, expected); the choice is
        // this function's, so it is tested over the hex strings.
        let held = ["abcdef01aa", "abcdef01bb", "1234567890"];
        let pick = |prefix: &str| {
            by_prefix(
                held.iter(),
                |s| s.to_string(),
                prefix,
                || "3 versions".into(),
            )
        };
        assert_eq!(pick("abcdef01a"), Ok(&"abcdef01aa"));
        assert_eq!(pick("12345678"), Ok(&"1234567890"));
        assert_eq!(pick("99999999"), Err(PrefixMiss::None("3 versions".into())));
        let ambiguous = pick("abcdef01").expect_err("two versions start with abcdef01");
        assert_eq!(
            ambiguous,
            PrefixMiss::Ambiguous(vec!["abcdef01aa".into(), "abcdef01bb".into()])
        );
        assert_eq!(
            ambiguous
                .pinned("hello@abcdef01::greet", "hello", "worker1", "abcdef01")
                .to_string(),
            Error::value(
                "hello@abcdef01::greet: version prefix abcdef01 of plugin hello is ambiguous on \
                 worker worker1: it matches abcdef01aa, abcdef01bb; give more digits"
            )
            .to_string()
        );
    }

    #[test]
    fn pinned_names_parse() {
        assert_eq!(
            parse_pinned("hello@0123abcd::greet"),
            Some(("hello", "0123abcd", "greet"))
        );
        assert_eq!(parse_pinned("hello::greet"), None);
        assert_eq!(parse_pinned("@x::f"), None);
        assert_eq!(parse_pinned("hello@ab::C.m"), Some(("hello", "ab", "C.m")));
    }
}
