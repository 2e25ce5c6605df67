//! `wasmrpc-plugins`: where the plugins under `plugins/` were built.
//!
//! Building this binary runs the package's build script, which builds every
//! plugin for `wasm32-unknown-unknown`; so `cargo run -q -p wasmrpc-plugins
//! -- param-server` prints the path of a `.wasm` file that exists and is up
//! to date with its sources. Tools outside the workspace's Rust code (the
//! xtask's demo, shell scripts) find plugins this way, through the same build
//! the tests use, instead of guessing paths under `target/`.

use std::process::ExitCode;

use wasmrpc_plugins::{PLUGINS, PYTHON_PLUGINS};

const HELP: &str = "\
Prints where the plugins under plugins/ were built for wasm32 (building them first, through
this package's build script, when `cargo run` runs it).

Usage:
  cargo run -q -p wasmrpc-plugins              every plugin: its package name and .wasm path
  cargo run -q -p wasmrpc-plugins -- NAME      the .wasm path of one plugin; NAME is its folder
                                               under plugins/ (param-server), its package name
                                               (wasmrpc-plugin-param-server) or its namespace
                                               (param_server)
  cargo run -q -p wasmrpc-plugins -- --dir     the folder holding every built plugin (for
                                               `wasmrpc launch --plugins`)
  cargo run -q -p wasmrpc-plugins -- --python-dir
                                               the folder holding the Python plugins under
                                               plugins/python/, built into components
";

/// The package name of the plugin a user means by `name`, in any of the
/// spellings [`HELP`] lists.
fn find(name: &str) -> Option<&'static (&'static str, &'static str)> {
    let wanted = name
        .strip_prefix("wasmrpc-plugin-")
        .unwrap_or(name)
        .replace('_', "-");
    PLUGINS
        .iter()
        .chain(PYTHON_PLUGINS)
        .find(|(package, _)| package.strip_prefix("wasmrpc-plugin-").unwrap_or(package) == wanted)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => {
            for (package, path) in PLUGINS.iter().chain(PYTHON_PLUGINS) {
                println!("{package}\t{path}");
            }
            ExitCode::SUCCESS
        }
        ["-h" | "--help"] => {
            print!("{HELP}");
            ExitCode::SUCCESS
        }
        ["--dir"] => match PLUGINS
            .first()
            .and_then(|(_, p)| std::path::Path::new(p).parent())
        {
            Some(dir) => {
                println!("{}", dir.display());
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("wasmrpc-plugins: no plugin was built (plugins/ has none)");
                ExitCode::FAILURE
            }
        },
        ["--python-dir"] => match PYTHON_PLUGINS
            .first()
            .and_then(|(_, p)| std::path::Path::new(p).parent())
        {
            Some(dir) => {
                println!("{}", dir.display());
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("wasmrpc-plugins: no Python plugin was built (plugins/python has none)");
                ExitCode::FAILURE
            }
        },
        [name] if !name.starts_with('-') => match find(name) {
            Some((_, path)) => {
                println!("{path}");
                ExitCode::SUCCESS
            }
            None => {
                let known: Vec<&str> = PLUGINS.iter().map(|(p, _)| *p).collect();
                eprintln!(
                    "wasmrpc-plugins: no plugin named {name:?} under plugins/ (there are: {})",
                    known.join(", ")
                );
                ExitCode::from(2)
            }
        },
        _ => {
            eprint!("wasmrpc-plugins: unexpected arguments {args:?}\n\n{HELP}");
            ExitCode::from(2)
        }
    }
}
