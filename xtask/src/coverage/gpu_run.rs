//! GPU run records: `tests/gpu-runs/<date>-<gpu>.tsv`, the outcome of every
//! test in one run of the `cargo xtask gpu-bundle` bundle on a GPU machine,
//! imported from the JUnit report and `machine.txt` its `run.sh` writes
//! (`cargo xtask coverage --gpu-run DIR`). CI has no GPU, so this record is
//! how `tests/SEED_COVERAGE.md` knows what ran on one: the newest record
//! becomes the table's "GPU run" section.
//!
//! A record keeps no test output (outputs of a run are not committed), only
//! each test's name, outcome and, for a skip, its reason.

use super::{Outcome, SeedTest, Status, read_junit};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The folder of the records, from the workspace root.
const RECORDS: &str = "tests/gpu-runs";

/// One imported run.
pub(crate) struct GpuRun {
    /// The record's file name.
    pub(crate) file: String,
    /// `machine.txt`'s `key: value` lines (date, torch, bundle, gpu).
    pub(crate) machine: Vec<(String, String)>,
    /// Every test case, as `binary::path::name`.
    pub(crate) cases: Vec<(String, Outcome)>,
}

/// Imports `dir/junit.xml` and `dir/machine.txt` as a record and returns its
/// path.
pub(crate) fn import(root: &Path, dir: &Path) -> Result<PathBuf> {
    let machine_path = dir.join("machine.txt");
    let machine_text = std::fs::read_to_string(&machine_path)
        .with_context(|| format!("reading {} (written by run.sh)", machine_path.display()))?;
    let machine: Vec<(String, String)> = machine_text
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let cases = read_junit(&dir.join("junit.xml"))?;
    if cases.is_empty() {
        bail!("{} holds no test case", dir.join("junit.xml").display());
    }
    let get = |key: &str| {
        machine
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    let date = get("date")
        .and_then(|d| d.get(..10))
        .context("machine.txt has no date line")?;
    let gpu = get("gpu").unwrap_or("no-gpu");
    let slug: String = gpu
        .split(',')
        .next()
        .unwrap_or(gpu)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let mut text = String::new();
    for (k, v) in &machine {
        let _ = writeln!(text, "# {k}: {v}");
    }
    text.push_str("test\toutcome\tdetail\n");
    let mut sorted = cases;
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, outcome) in &sorted {
        let (o, detail) = match outcome {
            Outcome::Passed => ("passed", ""),
            Outcome::Failed => ("failed", ""),
            Outcome::Skipped(why) => ("skipped", why.as_str()),
        };
        let _ = writeln!(text, "{name}\t{o}\t{detail}");
    }
    let folder = root.join(RECORDS);
    std::fs::create_dir_all(&folder)?;
    let path = folder.join(format!("{date}-{slug}.tsv"));
    std::fs::write(&path, text)?;
    Ok(path)
}

/// The newest record (by file name, which starts with the date), if any.
pub(crate) fn newest(root: &Path) -> Result<Option<GpuRun>> {
    let folder = root.join(RECORDS);
    let Ok(entries) = std::fs::read_dir(&folder) else {
        return Ok(None);
    };
    let Some(path) = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "tsv"))
        .max()
    else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut machine = Vec::new();
    let mut cases = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            if let Some((k, v)) = rest.split_once(": ") {
                machine.push((k.to_string(), v.to_string()));
            }
            continue;
        }
        let f: Vec<&str> = line.splitn(3, '\t').collect();
        match f.as_slice() {
            ["test", "outcome", "detail"] => {}
            [name, "passed", _] => cases.push((name.to_string(), Outcome::Passed)),
            [name, "failed", _] => cases.push((name.to_string(), Outcome::Failed)),
            [name, "skipped", why] => {
                cases.push((name.to_string(), Outcome::Skipped(why.to_string())));
            }
            _ => bail!("malformed line in {}: {line:?}", path.display()),
        }
    }
    Ok(Some(GpuRun {
        file: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        machine,
        cases,
    }))
}

/// The "GPU run" section: the run's machine and totals, then every seed test
/// that needs a GPU with its status in CI (no GPU) and in the run.
pub(crate) fn render(run: &GpuRun, rows: &[(&SeedTest, Status, Option<Status>)]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "\n## GPU run\n\nCI has no GPU. The newest GPU run record, `{RECORDS}/{}`: the tests \
         built against the GPU machine's libtorch (`cargo xtask gpu-bundle`), run there with \
         the bundle's `run.sh` and imported with `cargo xtask coverage --gpu-run DIR`.\n\n",
        run.file
    );
    for (k, v) in &run.machine {
        let _ = writeln!(out, "- {k}: {v}");
    }
    let count = |want: fn(&Outcome) -> bool| run.cases.iter().filter(|(_, o)| want(o)).count();
    let _ = writeln!(
        out,
        "- every test of the run: {} passed, {} failed, {} skipped at run time\n",
        count(|o| matches!(o, Outcome::Passed)),
        count(|o| matches!(o, Outcome::Failed)),
        count(|o| matches!(o, Outcome::Skipped(_))),
    );
    let gpu_rows: Vec<_> = rows.iter().filter(|(s, _, _)| s.needs != "-").collect();
    let mut totals: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, cpu, gpu) in &gpu_rows {
        *totals.entry(on_gpu(cpu, gpu.as_ref()).0).or_default() += 1;
    }
    let _ = writeln!(
        out,
        "Seed tests that need a GPU: {} ({}).\n",
        gpu_rows.len(),
        totals
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    out.push_str("| seed file | suite | test | in CI | on the GPU |\n|---|---|---|---|---|\n");
    for (s, cpu, gpu) in gpu_rows {
        let (_, cell) = on_gpu(cpu, gpu.as_ref());
        let _ = writeln!(
            out,
            "| `{}` | {} | `{}` | {} | {} |",
            s.file,
            s.suite,
            s.test,
            cpu.column(),
            cell.replace('|', "\\|")
        );
    }
    out
}

/// A seed test's GPU outcome: its totals column and its table cell.
fn on_gpu(cpu: &Status, gpu: Option<&Status>) -> (&'static str, String) {
    match (cpu, gpu) {
        (Status::NotApplicable(_), _) => ("not applicable", "not applicable".into()),
        (_, Some(status)) => (status.column(), status.cell()),
        (_, None) => ("not in the run", "not in the run".into()),
    }
}
