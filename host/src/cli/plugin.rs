//! `wasmrpc plugin`: tools for plugin files. `inspect` prints a plugin's
//! manifest (what the guest SDK's macros wrote into the module) without
//! compiling it: its name and the namespace its functions are served under,
//! version, protocol version, sha256, and every export with its kind and
//! parameters. `deploy` ships a plugin (or a new version of one) to every
//! worker of a running dynamic group (`wasmrpc::plugin::deploy` does the
//! work, in two phases: stage everywhere, then commit or abort): it joins
//! the group as a member of its own, deploys, prints what each worker did,
//! and leaves. `rollback` switches a plugin back to its previous version
//! the same way; `list` prints, per worker, the versions it holds.
//! `build-py` builds a Python plugin folder into a component
//! (`wasmrpc_pybuild` does the work, with componentize-py from the cache).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use wasmrpc::prelude::*;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use wasmrpc::wasm::manifest;
use wasmrpc::{RpcBackendOptions, init_rpc};

use super::parse_seconds;

/// Flags of `wasmrpc plugin`.
#[derive(clap::Args, Debug)]
pub(crate) struct PluginArgs {
    #[command(subcommand)]
    command: PluginCommand,
}

#[derive(clap::Subcommand, Debug)]
enum PluginCommand {
    /// Print a plugin's manifest: name, version, sha256, and its exports
    /// with their kind and parameters.
    Inspect {
        /// The plugin's `.wasm` file.
        file: PathBuf,
    },
    /// Deploy a plugin to every worker of a running group: join it as a
    /// member of its own, send the plugin to every other worker at once
    /// (each loads it and serves its functions as `namespace::function`),
    /// print what each worker did, and leave.
    ///
    /// The group must be dynamic (workers started without a world size,
    /// e.g. `wasmrpc worker --rank 0 --init-method tcp://HOST:PORT --serve
    /// --accept-plugin-deployment`); workers started without
    /// `--accept-plugin-deployment` refuse. Give it the workers' cluster
    /// secret as they were given it (`--cluster-secret-file FILE` or
    /// WASMRPC_CLUSTER_SECRET); the group's store holds no credentials. With
    /// TLS, give it a certificate of the cluster CA issued for the name it
    /// joins under (`wasmrpc cert issue deployer ...`, then `--name deployer
    /// --tls-ca ... --tls-cert ... --tls-key ...`).
    ///
    /// Two phases: every worker first stages the plugin (loads, compiles,
    /// checks it; callers see no change), then, only if all staged it, each
    /// makes it current (calls that start after that run it); if one
    /// refuses, nobody switches. A new version of a plugin the workers
    /// serve is an upgrade: the old one stays held for `plugin rollback`.
    /// The same bytes deployed again are a no-op. Exits non-zero unless
    /// every worker serves the plugin.
    Deploy(DeployArgs),
    /// Switch a plugin back to its previous version on every worker of a
    /// running group (they must all hold the same previous version, else
    /// nobody switches). Joins the group as `deploy` does.
    Rollback {
        /// The plugin's namespace (`hello` for `wasmrpc-plugin-hello`).
        namespace: String,
        #[command(flatten)]
        group: GroupArgs,
    },
    /// Print, per worker of a running group, the plugin versions it holds:
    /// which is current, previous, staged or draining, calls in flight and
    /// live objects per version, who deployed it and when. Joins the group
    /// as `deploy` does.
    List {
        #[command(flatten)]
        group: GroupArgs,
    },
    /// Build a Python plugin: the folder's `app.py` (functions marked
    /// `@remote`, classes `@remote_class`, from the guest kit's `wasmrpc`
    /// package) becomes one `.wasm` component that workers load like a
    /// Rust plugin. Needs componentize-py in the cache folder (`cargo xtask
    /// setup` installs it, and so does `--install-toolchain`). The guest kit
    /// and the WIT world come from the release bundle the binary runs from
    /// (`share/wasmrpc/sdk`), or `WASMRPC_SDK_DIR`, or the checkout.
    BuildPy {
        /// The plugin's folder; its name is the plugin's (`seed-fns-py`
        /// serves `seed_fns_py::NAME`) unless `--name` says otherwise.
        dir: PathBuf,
        /// Where to write the component [default: DIR/../NAME.wasm].
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// The plugin's name.
        #[arg(long)]
        name: Option<String>,
        /// The plugin's version.
        #[arg(long, default_value = "0.1.0")]
        version: String,
        /// The module holding the plugin's functions.
        #[arg(long, default_value = "app")]
        module: String,
        /// Install componentize-py first if it is missing (from PyPI, with
        /// the machine's `python3` or `$WASMRPC_PYTHON`, into the cache
        /// folder), as `cargo xtask setup` does in a checkout.
        #[arg(long)]
        install_toolchain: bool,
    },
}

/// Flags of `wasmrpc plugin deploy`.
#[derive(clap::Args, Debug)]
struct DeployArgs {
    /// The plugin's `.wasm` file.
    file: PathBuf,
    #[command(flatten)]
    group: GroupArgs,
}

/// How the plugin tools join a running group.
#[derive(clap::Args, Debug)]
struct GroupArgs {
    /// How to find the group's store, as the workers were given it:
    /// `tcp://HOST:PORT` (the store rank 0 hosts) or `file:///PATH`.
    #[arg(long)]
    init_method: String,
    /// The name this tool joins the group under [default: deploy-<PID>].
    #[arg(long)]
    name: Option<String>,
    /// The rank this tool joins under; it must not be a live member's
    /// [default: 2^30 + PID].
    #[arg(long)]
    rank: Option<u32>,
    /// How long each worker gets to load the plugin and answer, in seconds
    /// (0: no limit).
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    rpc_timeout: Duration,
    /// How long to wait for the group's store, in seconds.
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    init_timeout: Duration,
    #[command(flatten)]
    credentials: super::credentials::CredentialArgs,
}

/// Runs a `plugin` subcommand.
pub(crate) fn run(args: PluginArgs) -> Result<ExitCode> {
    match args.command {
        PluginCommand::Inspect { file } => {
            print!("{}", inspect(&file)?);
            Ok(ExitCode::SUCCESS)
        }
        PluginCommand::BuildPy {
            dir,
            output,
            name,
            version,
            module,
            install_toolchain,
        } => {
            let mut plugin = wasmrpc_pybuild::Plugin::in_dir(&dir).map_err(anyhow::Error::msg)?;
            plugin.version = version;
            plugin.module = module;
            if let Some(name) = name {
                plugin.name = name;
            }
            let out =
                output.unwrap_or_else(|| dir.join("..").join(format!("{}.wasm", plugin.name)));
            let toolchain = match wasmrpc_pybuild::Toolchain::find() {
                Ok(found) => found,
                Err(_) if install_toolchain => {
                    eprintln!(
                        "installing componentize-py {} from PyPI into {} (once)",
                        wasmrpc_pybuild::COMPONENTIZE_PY_VERSION,
                        wasmrpc_pybuild::Toolchain::default_dir()
                            .map_err(anyhow::Error::msg)?
                            .display()
                    );
                    wasmrpc_pybuild::Toolchain::install().map_err(anyhow::Error::msg)?
                }
                Err(missing) => return Err(anyhow::Error::msg(missing)),
            };
            let manifest = wasmrpc_pybuild::build(&toolchain, &plugin, &out)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("building the Python plugin in {}", dir.display()))?;
            println!(
                "wrote {} (guest kit: {})",
                out.display(),
                wasmrpc_pybuild::kit_dir().display()
            );
            print!("{}", manifest::describe(&manifest));
            Ok(ExitCode::SUCCESS)
        }
        PluginCommand::Deploy(args) => block_on(deploy(args)),
        PluginCommand::Rollback { namespace, group } => block_on(rollback(namespace, group)),
        PluginCommand::List { group } => block_on(list(group)),
    }
}

fn block_on(f: impl std::future::Future<Output = Result<ExitCode>>) -> Result<ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(f)
}

/// Joins the group as a member of its own: the agent, its name, and the
/// other members.
async fn join(args: GroupArgs) -> Result<(wasmrpc::RpcAgent, Vec<wasmrpc::WorkerInfo>)> {
    let pid = std::process::id();
    let rank = args.rank.unwrap_or((1 << 30) + pid % (1 << 30));
    let name = args.name.unwrap_or_else(|| format!("deploy-{pid}"));
    let mut options = RpcBackendOptions {
        rpc_timeout: args.rpc_timeout,
        init_method: args.init_method.clone(),
        init_timeout: args.init_timeout,
        ..RpcBackendOptions::default()
    };
    args.credentials.apply(&mut options, Some(&name))?;
    let store = super::dynamic_store(&args.init_method, rank, args.init_timeout).await?;
    let agent = init_rpc(&name, Some(rank), None, store, options)
        .await
        .with_context(|| format!("joining the group through {} failed", args.init_method))?;
    let workers: Vec<_> = agent
        .get_worker_infos()
        .into_iter()
        .filter(|w| w.name != name)
        .collect();
    Ok((agent, workers))
}

/// Leaves the group.
async fn leave(agent: wasmrpc::RpcAgent) -> Result<()> {
    agent
        .shutdown(true, Duration::ZERO)
        .await
        .context("leaving the group failed")
}

/// Joins the group, deploys to every other member, prints one line per
/// worker, leaves.
async fn deploy(args: DeployArgs) -> Result<ExitCode> {
    let wasm = std::fs::read(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let (agent, workers) = join(args.group).await?;
    let report = agent.deploy_plugin_to(&wasm, &workers).await;
    // Leave the group whatever happened, then report.
    let left = leave(agent).await;
    let report = report.with_context(|| format!("{} was not deployed", args.file.display()))?;
    left?;
    println!(
        "plugin {} {} (sha256 {}) to {} workers:",
        report.plugin,
        report.version,
        report.sha256,
        report.workers.len()
    );
    print_workers(&report);
    if workers.is_empty() {
        anyhow::bail!("the group has no workers besides this tool");
    }
    report.check()?;
    Ok(ExitCode::SUCCESS)
}

fn print_workers(report: &wasmrpc::DeployReport) {
    for w in &report.workers {
        match &w.result {
            Ok(names) if w.already_served => {
                println!("  {}: already served: {}", w.worker.name, names.join(", "));
            }
            Ok(names) if w.committed && names.is_empty() => {
                println!("  {}: switched", w.worker.name);
            }
            Ok(names) if w.committed => {
                println!("  {}: serving {}", w.worker.name, names.join(", "));
            }
            Ok(_) => println!(
                "  {}: staged, then dropped (another worker refused)",
                w.worker.name
            ),
            Err(e) => println!("  {}: FAILED: {}", w.worker.name, e.message()),
        }
    }
}

/// Joins the group, switches every other member back to the previous
/// version of `namespace`, leaves.
async fn rollback(namespace: String, group: GroupArgs) -> Result<ExitCode> {
    let (agent, workers) = join(group).await?;
    let report = agent.rollback_plugin(&namespace, &workers).await;
    let left = leave(agent).await;
    let report = report.with_context(|| format!("plugin {namespace} was not rolled back"))?;
    left?;
    println!(
        "plugin {} rolled back to {} (sha256 {}) on {} workers:",
        report.namespace,
        report.version,
        report.sha256,
        report.workers.len()
    );
    print_workers(&report);
    report.check()?;
    Ok(ExitCode::SUCCESS)
}

/// Joins the group, prints what every other member holds, leaves.
async fn list(group: GroupArgs) -> Result<ExitCode> {
    let (agent, workers) = join(group).await?;
    let mut failed = false;
    for w in &workers {
        match agent.plugin_versions(&w.name).await {
            Ok(held) if held.is_empty() => println!("{}: no deployed plugins", w.name),
            Ok(held) => {
                println!("{}:", w.name);
                for v in held {
                    println!(
                        "  {}@{} {} {} {}: {} calls in flight, {} objects; deployed by {} at {}",
                        v.namespace,
                        &v.sha256[..16],
                        v.plugin,
                        v.version,
                        v.role,
                        v.in_flight,
                        v.objects,
                        v.deployed_by,
                        utc(v.deployed_at)
                    );
                }
            }
            Err(e) => {
                failed = true;
                println!("{}: FAILED: {}", w.name, e.message());
            }
        }
    }
    leave(agent).await?;
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Seconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS UTC`.
fn utc(seconds: f64) -> String {
    let secs = seconds.max(0.0) as i64;
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// The report `inspect` prints: the manifest as the runtime describes it,
/// then the namespace the functions are served under and the sha256.
fn inspect(file: &PathBuf) -> Result<String> {
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let m = manifest::read(&bytes)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("{} is not a wasmrpc plugin", file.display()))?;
    let namespace = wasmrpc::plugin_namespace(&m.name);
    let sha256: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut out = manifest::describe(&m);
    if !m.abi_matches() {
        out.push_str("this host speaks another protocol version and cannot load it\n");
    }
    out.push_str(&format!(
        "namespace: {namespace} (functions are served as {namespace}::<fn>; a class's objects are \
         made with remote(worker, \"{namespace}::<Class>\", args) and called through the RRef)\n"
    ));
    out.push_str(&format!("sha256:    {sha256}\n"));
    Ok(out)
}
