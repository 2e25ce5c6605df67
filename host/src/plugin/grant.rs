//! [`PluginGrant`]: what one plugin may do on a worker, beyond what the
//! sandbox itself allows: which ops it runs and which registered functions
//! it calls (least privilege, issue 18).
//!
//! A plugin's rights depend on how it came to run ([`PluginTrust`]):
//! - loaded by the worker's operator (`--plugins`, [`PluginHost::register`]):
//!   every op the worker's [`OpPolicy`] serves, any function;
//! - deployed at run time by a peer ([`PluginHost::register_deployed`], what
//!   `deploy_plugin` does): the ops of the default families, and calls to
//!   its own functions (`namespace::*`) and to builtin ops only, plus what
//!   its manifest declares (`wasmrpc_guest::permissions!(ops = [...],
//!   calls = [...])`).
//!
//! Invariants:
//! - GR-1: a plugin never runs an op its worker's op policy refuses: its
//!   grant narrows the policy, never widens it (a declared op the operator
//!   did not allow, or denied, stays refused).
//! - GR-2: a deployed plugin's RPCs, `rpc_async`s and `remote`s name its
//!   own functions, builtin ops, or functions its manifest declares; any
//!   other target is refused on the calling worker, before anything is
//!   sent.
//!
//! [`PluginHost::register`]: super::PluginHost::register
//! [`PluginHost::register_deployed`]: super::PluginHost::register_deployed

use wasmrpc_torch_sys::{Admission, ErrorKind, OpError, OpGate, Target};
use wasmrpc_wasm::manifest::Manifest;

use crate::error::{Error, Result};
use crate::ops::policy::glob_match;
use crate::ops::{BuiltinOps, OpPolicy};

/// How a plugin came to run on a worker, which decides its defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginTrust {
    /// Loaded by the worker's operator (`--plugins`): trusted as far as
    /// the worker's op policy goes.
    Operator,
    /// Deployed at run time by a peer: least privilege.
    Deployed,
}

/// What one registered plugin may do on its worker (see the module docs).
#[derive(Debug)]
pub(crate) struct PluginGrant {
    /// The plugin's namespace (`hello`).
    namespace: String,
    trust: PluginTrust,
    /// For a deployed plugin: its own op policy (the default families plus
    /// the ops it declares), which the worker's policy must admit too.
    ops: Option<OpPolicy>,
    /// For a deployed plugin: the function patterns it declares.
    calls: Vec<String>,
}

impl PluginGrant {
    /// The grant of a plugin its operator loaded.
    pub(crate) fn operator(namespace: &str) -> PluginGrant {
        PluginGrant {
            namespace: namespace.to_owned(),
            trust: PluginTrust::Operator,
            ops: None,
            calls: Vec::new(),
        }
    }

    /// The grant of a plugin deployed at run time, with what `manifest`
    /// declares.
    ///
    /// # Errors
    /// `ValueError` naming the plugin for a declared op pattern the policy
    /// cannot read.
    pub(crate) fn deployed(namespace: &str, manifest: &Manifest) -> Result<PluginGrant> {
        let mut ops = OpPolicy::default();
        for pattern in &manifest.permissions.ops {
            ops = ops.allow(pattern).map_err(|e| {
                Error::value(format!(
                    "plugin {} declares op pattern {pattern:?}, which is not one: {}",
                    manifest.name,
                    e.message()
                ))
            })?;
        }
        Ok(PluginGrant {
            namespace: namespace.to_owned(),
            trust: PluginTrust::Deployed,
            ops: Some(ops),
            calls: manifest.permissions.calls.clone(),
        })
    }

    /// How the plugin came to run on the worker.
    pub(crate) fn trust(&self) -> PluginTrust {
        self.trust
    }

    /// Whether the plugin may call `function` (a qualified name) by RPC
    /// (GR-2).
    ///
    /// # Errors
    /// `RuntimeError` naming the worker, the plugin, the function and how
    /// to declare it.
    pub(crate) fn admit_call(&self, function: &str, worker: &str) -> Result<()> {
        if self.trust == PluginTrust::Operator
            || function
                .strip_prefix(self.namespace.as_str())
                .is_some_and(|rest| rest.starts_with("::") || rest.starts_with('@'))
            || self.calls.iter().any(|p| glob_match(p, function))
            || BuiltinOps::knows(function)
        {
            return Ok(());
        }
        Err(Error::runtime(format!(
            "{worker} does not let plugin {ns} call {function}: a plugin deployed at run time \
             calls its own functions ({ns}::*) and builtin ops; declare others with \
             wasmrpc_guest::permissions!(calls = [\"{function}\"])",
            ns = self.namespace
        )))
    }
}

/// The [`OpGate`] of a plugin's tensor ops: the worker's policy, then the
/// plugin's own grant (GR-1).
pub(crate) struct PluginGate<'a> {
    /// The worker's op policy.
    pub(crate) policy: &'a OpPolicy,
    /// The worker's name, for refusals.
    pub(crate) worker: &'a str,
    /// The plugin's grant.
    pub(crate) grant: &'a PluginGrant,
}

impl OpGate for PluginGate<'_> {
    fn admit(&self, admission: &Admission<'_>) -> std::result::Result<(), OpError> {
        self.policy.admit(admission, self.worker)?;
        let Some(ops) = &self.grant.ops else {
            return Ok(());
        };
        ops.admit(admission, self.worker).map_err(|_| {
            let op = match admission.target {
                Target::Op(op) => op.name(),
                Target::Builtin(name) => name,
            };
            OpError::Rejected {
                kind: ErrorKind::RuntimeError,
                message: format!(
                    "{worker} does not run {op} for plugin {ns}: a plugin deployed at run time \
                     runs the worker's op families and the ops its manifest declares, and not \
                     this one (declare it with wasmrpc_guest::permissions!(ops = [\"{op}\"]); \
                     the worker's op policy must serve it too)",
                    worker = self.worker,
                    ns = self.grant.namespace
                ),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    //! POLICY_TEST_NAMES_DENIED_OPS: names here are refused on purpose.

    use super::*;
    use wasmrpc_abi::manifest::Permissions;
    use wasmrpc_torch_sys::{OpValue, Operator};

    fn manifest(ops: &[&str], calls: &[&str]) -> Manifest {
        Manifest {
            name: "wasmrpc-plugin-probe".into(),
            version: "0.1.0".into(),
            abi: wasmrpc_abi::protocol::ABI_VERSION,
            exports: Vec::new(),
            permissions: Permissions {
                ops: ops.iter().map(|s| (*s).to_owned()).collect(),
                calls: calls.iter().map(|s| (*s).to_owned()).collect(),
            },
            reaches_objects: Vec::new(),
            single_instance: false,
        }
    }

    fn admit(gate: &PluginGate<'_>, name: &str) -> std::result::Result<(), OpError> {
        let op = Operator::resolve(name).unwrap();
        gate.admit(&Admission {
            target: Target::Op(&op),
            args: &[OpValue::Str("/x".into())],
            kwargs: &[],
            method: false,
        })
    }

    #[test]
    fn a_deployed_plugin_calls_its_own_functions_builtins_and_what_it_declares() {
        let grant =
            PluginGrant::deployed("probe", &manifest(&[], &["seed_fns::identity", "hello::*"]))
                .unwrap();
        for ok in [
            "probe::relay",
            "aten::add",
            "builtins.min",
            "seed_fns::identity",
            "hello::greet",
        ] {
            assert!(grant.admit_call(ok, "worker1").is_ok(), "{ok}");
        }
        for refused in [
            "seed_fns::raise_func",
            "probe2::x",
            "prob::x",
            "wasmrpc::_rref_fetch",
        ] {
            let e = grant.admit_call(refused, "worker1").unwrap_err();
            assert_eq!(e.kind(), ErrorKind::RuntimeError);
            assert!(
                e.message()
                    .starts_with(&format!("worker1 does not let plugin probe call {refused}")),
                "{e}"
            );
        }
        let trusted = PluginGrant::operator("probe");
        assert!(
            trusted
                .admit_call("seed_fns::raise_func", "worker1")
                .is_ok()
        );
    }

    #[test]
    fn declared_ops_narrow_the_worker_policy_and_never_widen_it() {
        let worker = OpPolicy::default()
            .allow("aten::from_file")
            .unwrap()
            .allow("aten::empty")
            .unwrap();
        let declared =
            PluginGrant::deployed("probe", &manifest(&["aten::from_file"], &[])).unwrap();
        let gate = PluginGate {
            policy: &worker,
            worker: "worker1",
            grant: &declared,
        };
        assert!(admit(&gate, "aten::add").is_ok(), "families are granted");
        assert!(
            admit(&gate, "aten::from_file").is_ok(),
            "declared and allowed"
        );
        let e = admit(&gate, "aten::empty").unwrap_err().to_string();
        assert!(
            e.starts_with("worker1 does not run aten::empty for plugin probe"),
            "{e}"
        );
        assert!(e.contains("permissions!(ops = [\"aten::empty\"])"), "{e}");

        // Declared, but the worker's operator did not allow it.
        let strict = OpPolicy::default();
        let gate = PluginGate {
            policy: &strict,
            worker: "worker1",
            grant: &declared,
        };
        let e = admit(&gate, "aten::from_file").unwrap_err().to_string();
        assert!(
            e.starts_with("worker1 does not run aten::from_file: the op takes a file name"),
            "{e}"
        );
        // Declared and allowed, but denied.
        let denying = worker.clone().deny("aten::from_file").unwrap();
        let gate = PluginGate {
            policy: &denying,
            worker: "worker1",
            grant: &declared,
        };
        assert!(admit(&gate, "aten::from_file").is_err());

        // The operator's own plugins get the whole policy.
        let trusted = PluginGrant::operator("probe");
        let gate = PluginGate {
            policy: &worker,
            worker: "worker1",
            grant: &trusted,
        };
        assert!(admit(&gate, "aten::empty").is_ok());

        let e = PluginGrant::deployed("probe", &manifest(&["aten::add.Tensor"], &[])).unwrap_err();
        assert!(
            e.message()
                .contains("plugin wasmrpc-plugin-probe declares op pattern"),
            "{e}"
        );
    }
}
