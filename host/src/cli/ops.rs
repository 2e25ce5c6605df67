//! `wasmrpc ops`: what a worker's op policy serves. The policy flags
//! (`--allow-op`, `--deny-op`, `--op-policy`) are defined here once, for
//! `worker`, `launch` (which passes them to every worker it starts) and
//! `ops list`, so all three read a policy the same way.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use wasmrpc::OpPolicy;
use wasmrpc::op_policy::{Action, Denial, FAMILIES, Verdict};

/// The op policy flags of `worker`, `launch` and `ops list`.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct OpPolicyArgs {
    /// Also serve the ops PATTERN matches: an op (`aten::from_file`,
    /// `torch.ops.aten.from_file`), a glob (`aten::linalg_*`, `prim::*`), or
    /// a family (`@random`). Naming an op exactly serves every overload;
    /// globs and families never serve overloads whose schemas are unsafe.
    /// Repeatable.
    #[arg(long = "allow-op", value_name = "PATTERN")]
    allow: Vec<String>,
    /// Refuse the ops PATTERN matches, whatever allows them (deny rules
    /// win). Repeatable.
    #[arg(long = "deny-op", value_name = "PATTERN")]
    deny: Vec<String>,
    /// Read more rules from FILE: one a line, `allow PATTERN` or `deny
    /// PATTERN`, `#` comments.
    #[arg(long = "op-policy", value_name = "FILE")]
    file: Option<PathBuf>,
}

impl OpPolicyArgs {
    /// The policy these flags describe: the default families, the file's
    /// rules, then the flags' (deny rules win whatever their order).
    ///
    /// # Errors
    /// An unreadable policy file, or a bad rule or pattern (with its file and
    /// line, or its flag).
    pub(crate) fn policy(&self) -> Result<OpPolicy> {
        let mut policy = OpPolicy::default();
        if let Some(file) = &self.file {
            policy = policy.rules_from_file(file)?;
        }
        for pattern in &self.allow {
            policy = policy.rule(Action::Allow, pattern, Some("--allow-op".into()))?;
        }
        for pattern in &self.deny {
            policy = policy.rule(Action::Deny, pattern, Some("--deny-op".into()))?;
        }
        Ok(policy)
    }

    /// The same flags for a child `wasmrpc worker`, the file's path made
    /// absolute.
    ///
    /// # Errors
    /// A policy file path that cannot be made absolute.
    pub(crate) fn child_args(&self) -> Result<Vec<OsString>> {
        let mut args = Vec::new();
        if let Some(file) = &self.file {
            let file = std::path::absolute(file)
                .with_context(|| format!("bad op policy path {}", file.display()))?;
            args.push("--op-policy".into());
            args.push(file.into_os_string());
        }
        for pattern in &self.allow {
            args.push("--allow-op".into());
            args.push(pattern.into());
        }
        for pattern in &self.deny {
            args.push("--deny-op".into());
            args.push(pattern.into());
        }
        Ok(args)
    }
}

/// Flags of `wasmrpc ops`.
#[derive(clap::Args, Debug)]
pub(crate) struct OpsArgs {
    #[command(subcommand)]
    command: OpsCommand,
}

#[derive(clap::Subcommand, Debug)]
enum OpsCommand {
    /// Print the builtin ops a worker with these flags serves to peers and
    /// plugins, one a line: the op, a tab, and why it is served (its family,
    /// or the rule that allows it), with any overloads withheld for their
    /// unsafe schemas. With --denied, print every other op libtorch
    /// registers instead, with why it is refused: a deny rule, another
    /// namespace than aten, private (`_` first), an unsafe schema (a
    /// Storage, Stream, Generator, file name, raw pointer or opaque type),
    /// not in a family, or not callable by name at all.
    ///
    /// Without flags this is the default policy, which serves the families
    /// `wasmrpc ops families` lists and nothing else.
    List {
        /// Print the refused ops instead, with their reasons.
        #[arg(long)]
        denied: bool,
        #[command(flatten)]
        policy: OpPolicyArgs,
    },
    /// Print the op families the default policy serves, each with what its
    /// ops do and how many there are (name them with @FAMILY in rules).
    Families,
}

/// Runs an `ops` subcommand.
pub(crate) fn run(args: OpsArgs) -> Result<ExitCode> {
    match args.command {
        OpsCommand::List { denied, policy } => {
            let policy = policy.policy()?;
            let (text, served, refused) = list(&policy, denied);
            print!("{text}");
            eprintln!("{served} ops served, {refused} refused");
        }
        OpsCommand::Families => {
            for f in FAMILIES {
                println!(
                    "@{}\t{} ops\t{}",
                    f.name,
                    f.member_names().count(),
                    f.summary
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The lines of `ops list` (served ops, or with `denied` the refused ones),
/// and how many ops are served and refused.
fn list(policy: &OpPolicy, denied: bool) -> (String, usize, usize) {
    let (mut text, mut served, mut refused) = (String::new(), 0, 0);
    for (name, verdict) in policy.every_op() {
        let line = match verdict.as_deref() {
            Ok(Verdict::Allowed { by, withheld }) => {
                served += 1;
                if denied {
                    continue;
                }
                let mut line = by.to_string();
                if !withheld.is_empty() {
                    let schemas: Vec<&str> = withheld.iter().map(|o| o.schema()).collect();
                    line.push_str(&format!(" (withheld: {})", schemas.join("; ")));
                }
                line
            }
            Ok(Verdict::Denied(denial)) => {
                refused += 1;
                if !denied {
                    continue;
                }
                match denial {
                    Denial::Rule(rule) => format!("deny rule: {rule}"),
                    Denial::OtherNamespace(ns) => format!("other namespace: {ns}"),
                    Denial::Private => "private".to_owned(),
                    Denial::UnsafeSchema(hazard) => format!("unsafe schema: {hazard}"),
                    Denial::NotInFamily => "not in a family".to_owned(),
                }
            }
            Err(e) => {
                refused += 1;
                if !denied {
                    continue;
                }
                format!("not callable by name: {e}")
            }
        };
        text.push_str(&format!("{name}\t{line}\n"));
    }
    (text, served, refused)
}

#[cfg(test)]
mod tests {
    //! POLICY_TEST_NAMES_DENIED_OPS: names here are refused on purpose.

    use super::*;

    fn line<'a>(text: &'a str, op: &str) -> Option<&'a str> {
        text.lines().find(|l| l.split('\t').next() == Some(op))
    }

    #[test]
    fn the_list_gives_each_op_its_family_or_its_reason() {
        let policy = OpPolicy::default();
        let (served, n_served, n_refused) = list(&policy, false);
        assert_eq!(served.lines().count(), n_served);
        assert_eq!(line(&served, "aten::matmul"), Some("aten::matmul\t@linalg"));
        let add = line(&served, "aten::add").unwrap();
        assert!(
            add.starts_with("aten::add\t@arithmetic (withheld: aten::add.t("),
            "{add}"
        );
        assert_eq!(
            line(&served, "builtins.min"),
            Some("builtins.min\t@builtins")
        );
        assert!(line(&served, "aten::from_file").is_none());
        let (refused, _, _) = list(&policy, true);
        assert_eq!(refused.lines().count(), n_refused);
        let from_file = line(&refused, "aten::from_file").unwrap();
        assert!(
            from_file.contains("unsafe schema: takes a file name"),
            "{from_file}"
        );
        assert_eq!(
            line(&refused, "prim::dtype"),
            Some("prim::dtype\tother namespace: prim")
        );
        assert!(line(&refused, "aten::add").is_none());
    }

    #[test]
    fn flags_build_the_policy_and_travel_to_children() {
        let args = OpPolicyArgs {
            allow: vec!["aten::from_file".into()],
            deny: vec!["@random".into()],
            file: Some("ops.policy".into()),
        };
        let child: Vec<String> = args
            .child_args()
            .unwrap()
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(child[0], "--op-policy");
        assert!(std::path::Path::new(&child[1]).is_absolute() && child[1].ends_with("ops.policy"));
        assert_eq!(
            child[2..],
            ["--allow-op", "aten::from_file", "--deny-op", "@random"]
        );
        let args = OpPolicyArgs { file: None, ..args };
        let policy = args.policy().unwrap();
        let (served, _, _) = list(&policy, false);
        assert_eq!(
            line(&served, "aten::from_file"),
            Some("aten::from_file\tallow aten::from_file (--allow-op)")
        );
        let (refused, _, _) = list(&policy, true);
        assert_eq!(
            line(&refused, "aten::rand"),
            Some("aten::rand\tdeny rule: deny @random (--deny-op)")
        );
        let bad = OpPolicyArgs {
            deny: vec!["aten::add.Tensor".into()],
            ..OpPolicyArgs::default()
        };
        let e = bad.policy().unwrap_err().to_string();
        assert!(
            e.contains("--deny-op: op pattern \"aten::add.Tensor\" names overload"),
            "{e}"
        );
    }
}
