//! `tests/SEED_COVERAGE.md`: the status of every seed test, generated from
//! the list of seed tests (`seed-tests.tsv` in the project's seed folder,
//! beside the checkout or where `WASMRPC_SHARED` says), the not-applicable
//! table and the JUnit report of the last `cargo xtask test` run.
//!
//! A seed test is marked passing only when a test of the same name ran in
//! that report and passed without printing a skip marker.

mod gpu_run;

pub(crate) use gpu_run::import as import_gpu_run;

use anyhow::{Context, Result};
use quick_xml::Reader;
use quick_xml::events::Event;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What a test prints when it skips at run time (no GPU, no PyTorch).
const SKIP_MARKER: &str = "wasmrpc-skip:";

/// One row of `seed-tests.tsv`.
struct SeedTest {
    file: String,
    suite: String,
    test: String,
    area: String,
    port: String,
    needs: String,
}

/// The outcome of one test case in the JUnit report.
#[derive(Clone, Debug)]
enum Outcome {
    Passed,
    Failed,
    Skipped(String),
}

/// What the coverage table says of one seed test.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Status {
    Passing,
    Failing,
    Skipped(String),
    NotApplicable(String),
    NotRun,
    /// Not ported yet, with why (the area's entry in
    /// `tests/support/not_yet_ported.tsv`, if any).
    NotPorted(Option<String>),
}

impl Status {
    fn column(&self) -> &'static str {
        match self {
            Status::Passing => "passing",
            Status::Failing => "failing",
            Status::Skipped(_) => "skipped",
            Status::NotApplicable(_) => "not applicable",
            Status::NotRun => "not run",
            Status::NotPorted(_) => "not yet ported",
        }
    }
    fn cell(&self) -> String {
        match self {
            Status::Skipped(why) => format!("skipped: {why}"),
            Status::NotApplicable(why) => format!("not applicable: {why}"),
            Status::NotRun => "not run (ported, absent from the last test report)".into(),
            Status::NotPorted(Some(why)) => format!("not yet ported: {why}"),
            other => other.column().into(),
        }
    }
}

const COLUMNS: [&str; 6] = [
    "passing",
    "failing",
    "skipped",
    "not applicable",
    "not run",
    "not yet ported",
];

/// Totals of a regeneration, for the console.
pub(crate) struct Report {
    counts: BTreeMap<&'static str, usize>,
    total: usize,
    tests_passed: usize,
    tests_failed: usize,
    tests_skipped: usize,
}

impl Report {
    /// One line of seed-coverage totals.
    pub(crate) fn summary_line(&self) -> String {
        let mut line = format!("seed coverage ({} seed tests):", self.total);
        for c in COLUMNS {
            let _ = write!(line, " {} {c},", self.counts.get(c).copied().unwrap_or(0));
        }
        line.pop();
        line
    }

    /// The run's closing line: every Rust test case of the report.
    pub(crate) fn closing_line(&self) -> String {
        format!(
            "tests: {} passed, {} failed, {} skipped",
            self.tests_passed, self.tests_failed, self.tests_skipped
        )
    }
}

/// Rewrites `tests/SEED_COVERAGE.md` and returns its totals.
pub(crate) fn regenerate(root: &Path) -> Result<Report> {
    let seeds = read_seed_tests(&shared_dir(root).join("seed-tests.tsv"))?;
    let not_applicable = read_not_applicable(&root.join("tests/support/not_applicable.tsv"))?;
    let not_yet = read_not_yet_ported(&root.join("tests/support/not_yet_ported.tsv"))?;
    let junit_path = target_dir(root).join("nextest/ci/junit.xml");
    let cases = if junit_path.exists() {
        read_junit(&junit_path)?
    } else {
        Vec::new()
    };
    let defined = defined_test_fns(root)?;

    let mut ambiguous: HashMap<(&str, &str), usize> = HashMap::new();
    for s in &seeds {
        *ambiguous.entry((&s.file, &s.test)).or_default() += 1;
    }

    let mut rows = Vec::new();
    for s in &seeds {
        let listed = not_applicable
            .get(&(s.file.clone(), s.suite.clone(), s.test.clone()))
            .cloned();
        // A python-only seed test has no port unless a natural equivalent
        // was found (a test of its name exists); any other seed test listed
        // in the table has no port by decision (e.g. what Rust's types rule
        // out), unless a test of its name exists after all.
        let status = if s.port == "python-only" && !defined.contains(&s.test) {
            Status::NotApplicable(listed.unwrap_or_else(|| {
                "python-only (reason missing from tests/support/not_applicable.tsv)".into()
            }))
        } else if let Some(why) = listed.filter(|_| !defined.contains(&s.test)) {
            Status::NotApplicable(why)
        } else {
            let needs_suite = ambiguous[&(s.file.as_str(), s.test.as_str())] > 1;
            match outcome_of(s, &cases, needs_suite) {
                Some(status) => status,
                None if defined.contains(&s.test) => Status::NotRun,
                None => Status::NotPorted(
                    not_yet
                        .get(&(s.file.clone(), s.test.clone()))
                        .or_else(|| not_yet.get(&(s.file.clone(), s.area.clone())))
                        .or_else(|| not_yet.get(&(s.file.clone(), "*".into())))
                        .cloned(),
                ),
            }
        };
        rows.push((s, status));
    }

    let mut markdown = render(&rows, junit_path.exists());
    if let Some(run) = gpu_run::newest(root)? {
        let with_gpu: Vec<(&SeedTest, Status, Option<Status>)> = rows
            .iter()
            .map(|(s, st)| {
                let needs_suite = ambiguous[&(s.file.as_str(), s.test.as_str())] > 1;
                (*s, st.clone(), outcome_of(s, &run.cases, needs_suite))
            })
            .collect();
        markdown.push_str(&gpu_run::render(&run, &with_gpu));
    }
    std::fs::write(root.join("tests/SEED_COVERAGE.md"), markdown)?;

    let mut counts = BTreeMap::new();
    for (_, st) in &rows {
        *counts.entry(st.column()).or_insert(0) += 1;
    }
    Ok(Report {
        counts,
        total: rows.len(),
        tests_passed: cases
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Passed))
            .count(),
        tests_failed: cases
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Failed))
            .count(),
        tests_skipped: cases
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Skipped(_)))
            .count(),
    })
}

/// What `cases` say of seed test `s`: failing if any test of its name
/// failed, skipped if one skipped, passing if all passed; `None` if none ran.
/// A test matches by its name, inside a module named after the seed file
/// (and after the suite when `needs_suite`: the name is shared by several).
fn outcome_of(s: &SeedTest, cases: &[(String, Outcome)], needs_suite: bool) -> Option<Status> {
    let suite = snake_case(&s.suite);
    let matched: Vec<&Outcome> = cases
        .iter()
        .filter(|(path, _)| {
            let parts: Vec<&str> = path.split("::").collect();
            parts.last() == Some(&s.test.as_str())
                && parts.contains(&s.file.as_str())
                && (!needs_suite || parts.contains(&suite.as_str()))
        })
        .map(|(_, o)| o)
        .collect();
    if matched.is_empty() {
        None
    } else if matched.iter().any(|o| matches!(o, Outcome::Failed)) {
        Some(Status::Failing)
    } else if let Some(Outcome::Skipped(why)) =
        matched.iter().find(|o| matches!(o, Outcome::Skipped(_)))
    {
        Some(Status::Skipped(why.clone()))
    } else {
        Some(Status::Passing)
    }
}

fn render(rows: &[(&SeedTest, Status)], had_report: bool) -> String {
    let mut out = String::new();
    out.push_str("# Seed test coverage\n\n");
    out.push_str(
        "Generated by `cargo xtask coverage` (also run by `cargo xtask test`) from \
         the list of PyTorch's seed tests, `tests/support/not_applicable.tsv` (seed tests with \
         no port and why), `tests/support/not_yet_ported.tsv` (why a test or an area is not \
         ported yet), the \
         JUnit report of the last test run and, for its last section, the newest GPU run \
         record in `tests/gpu-runs/`. Do not edit by hand.\n\n",
    );
    if !had_report {
        out.push_str("**No test report was found: no test is marked as run.**\n\n");
    }
    out.push_str(
        "A seed test is *passing* only if a Rust test of the same name (inside a module named \
         after its seed file, and after its suite when the name is shared by several suites) ran \
         and passed. *Skipped* tests ran but skipped at run time (no GPU, for example). *Not run* \
         means a test of that name exists but was not in the report.\n\n",
    );

    let mut by_file: BTreeMap<&str, BTreeMap<&'static str, usize>> = BTreeMap::new();
    let mut by_area: BTreeMap<(&str, &str), BTreeMap<&'static str, usize>> = BTreeMap::new();
    for (s, st) in rows {
        *by_file
            .entry(&s.file)
            .or_default()
            .entry(st.column())
            .or_default() += 1;
        *by_area
            .entry((&s.file, &s.area))
            .or_default()
            .entry(st.column())
            .or_default() += 1;
    }
    let header = |first: &str| {
        let mut h = format!("| {first} | total |");
        for c in COLUMNS {
            let _ = write!(h, " {c} |");
        }
        h.push('\n');
        h.push_str(&"|---".repeat(COLUMNS.len() + 2));
        h.push_str("|\n");
        h
    };
    let line = |label: String, counts: &BTreeMap<&'static str, usize>| {
        let total: usize = counts.values().sum();
        let mut l = format!("| {label} | {total} |");
        for c in COLUMNS {
            let _ = write!(l, " {} |", counts.get(c).copied().unwrap_or(0));
        }
        l.push('\n');
        l
    };

    out.push_str("## Totals per seed file\n\n");
    out.push_str(&header("seed file"));
    let mut all = BTreeMap::new();
    for (file, counts) in &by_file {
        out.push_str(&line(format!("`{file}`"), counts));
        for (k, v) in counts {
            *all.entry(*k).or_insert(0) += v;
        }
    }
    out.push_str(&line("**all**".into(), &all));

    out.push_str("\n## Totals per area\n\n");
    out.push_str(&header("seed file / area"));
    for ((file, area), counts) in &by_area {
        out.push_str(&line(format!("`{file}` {area}"), counts));
    }

    let mut current = "";
    for (s, st) in rows {
        if s.file != current {
            current = &s.file;
            let _ = write!(
                out,
                "\n## `{current}`\n\n| suite | test | area | class | needs | status |\n|---|---|---|---|---|---|\n"
            );
        }
        let _ = writeln!(
            out,
            "| {} | `{}` | {} | {} | {} | {} |",
            s.suite,
            s.test,
            s.area,
            s.port,
            s.needs,
            st.cell().replace('|', "\\|")
        );
    }
    out
}

fn shared_dir(root: &Path) -> PathBuf {
    std::env::var_os("WASMRPC_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("..").join("shared"))
}

/// The cargo target folder (`CARGO_TARGET_DIR` or `target/`).
pub(crate) fn target_dir(root: &Path) -> PathBuf {
    // Cargo reads a relative CARGO_TARGET_DIR from its working folder, which
    // is `root` for every cargo command the xtask runs.
    std::env::var_os("CARGO_TARGET_DIR")
        .filter(|d| !d.is_empty())
        .map(|d| root.join(d))
        .unwrap_or_else(|| root.join("target"))
}

fn read_seed_tests(path: &Path) -> Result<Vec<SeedTest>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "could not read {} (the shared/ folder beside the repo)",
            path.display()
        )
    })?;
    let mut out = Vec::new();
    for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() < 6 {
            anyhow::bail!("malformed line in {}: {line:?}", path.display());
        }
        out.push(SeedTest {
            file: f[0].into(),
            suite: f[1].into(),
            test: f[2].into(),
            area: f[3].into(),
            port: f[4].into(),
            needs: f[5].into(),
        });
    }
    Ok(out)
}

fn read_not_applicable(path: &Path) -> Result<HashMap<(String, String, String), String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("could not read {}", path.display()))?;
    let mut out = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let f: Vec<&str> = line.splitn(4, '\t').collect();
        if f.len() < 4 {
            anyhow::bail!("malformed line in {}: {line:?}", path.display());
        }
        out.insert((f[0].into(), f[1].into(), f[2].into()), f[3].into());
    }
    Ok(out)
}

/// `seed_file \t area-or-test \t reason` lines: why a test, or an area's
/// tests, are not ported yet (`*` for every area of the file).
fn read_not_yet_ported(path: &Path) -> Result<HashMap<(String, String), String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("could not read {}", path.display()))?;
    let mut out = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let f: Vec<&str> = line.splitn(3, '\t').collect();
        if f.len() < 3 {
            anyhow::bail!("malformed line in {}: {line:?}", path.display());
        }
        out.insert((f[0].into(), f[1].into()), f[2].into());
    }
    Ok(out)
}

/// Every test case in a nextest JUnit report, as `binary::path::name`.
fn read_junit(path: &Path) -> Result<Vec<(String, Outcome)>> {
    let text = std::fs::read_to_string(path)?;
    let mut reader = Reader::from_str(&text);
    let mut cases = Vec::new();
    let mut current: Option<(String, Outcome)> = None;
    let mut in_output = false;
    loop {
        match reader
            .read_event()
            .with_context(|| format!("malformed {}", path.display()))?
        {
            Event::Start(e) | Event::Empty(e) if e.name().0 == "testcase" => {
                if let Some(done) = current.take() {
                    cases.push(done);
                }
                let mut name = String::new();
                let mut class = String::new();
                for a in e.attributes().flatten() {
                    let raw = a.value.clone();
                    let v = quick_xml::escape::unescape(&raw)
                        .map(|v| v.into_owned())
                        .unwrap_or_else(|_| raw.to_string());
                    match a.key.0 {
                        "name" => name = v,
                        "classname" => class = v,
                        _ => {}
                    }
                }
                current = Some((format!("{class}::{name}"), Outcome::Passed));
            }
            Event::Start(e) | Event::Empty(e) => match e.name().0 {
                "failure" | "error" | "flakyFailure" | "rerunFailure" => {
                    if let Some((_, o)) = current.as_mut() {
                        *o = Outcome::Failed;
                    }
                }
                "skipped" => {
                    if let Some((_, o)) = current.as_mut() {
                        *o = Outcome::Skipped("ignored".into());
                    }
                }
                "system-out" | "system-err" => in_output = true,
                _ => {}
            },
            Event::Text(t) if in_output => {
                let text = t.xml10_content().into_owned();
                if let (Some((_, o @ Outcome::Passed)), Some(pos)) =
                    (current.as_mut(), text.find(SKIP_MARKER))
                {
                    let why = text[pos + SKIP_MARKER.len()..]
                        .lines()
                        .next()
                        .unwrap_or("")
                        .trim();
                    *o = Outcome::Skipped(why.to_string());
                }
            }
            Event::End(e) => match e.name().0 {
                "system-out" | "system-err" => in_output = false,
                "testcase" => {
                    if let Some(done) = current.take() {
                        cases.push(done);
                    }
                }
                _ => {}
            },
            Event::Eof => break,
            _ => {}
        }
    }
    if let Some(done) = current.take() {
        cases.push(done);
    }
    Ok(cases)
}

/// Names of every `fn` in the repo's Rust sources outside `target/`, to tell
/// a ported test that did not run from one that does not exist.
fn defined_test_fns(root: &Path) -> Result<HashSet<String>> {
    let mut names = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" {
                    stack.push(path);
                }
            } else if name.ends_with(".rs") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                for rest in text.split("fn ").skip(1) {
                    let ident: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !ident.is_empty() {
                        names.insert(ident);
                    }
                }
            }
        }
    }
    Ok(names)
}

/// `TensorPipeAgentRpcTest` → `tensor_pipe_agent_rpc_test`, `TP-Rpc` → `tp_rpc`.
fn snake_case(name: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = name.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        if c.is_ascii_uppercase() {
            let prev_lower = i > 0 && chars[i - 1].is_ascii_lowercase();
            let next_lower = chars.get(i + 1).is_some_and(|n| n.is_ascii_lowercase());
            let prev_upper = i > 0 && chars[i - 1].is_ascii_uppercase();
            if i > 0 && !out.ends_with('_') && (prev_lower || (prev_upper && next_lower)) {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else if c.is_ascii_alphanumeric() {
            out.push(c);
        } else if !out.ends_with('_') {
            out.push('_');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::snake_case;

    #[test]
    fn suite_names_become_module_names() {
        assert_eq!(
            snake_case("TensorPipeAgentRpcTest"),
            "tensor_pipe_agent_rpc_test"
        );
        assert_eq!(snake_case("TP-Rpc"), "tp_rpc");
        assert_eq!(snake_case("TP-Cuda"), "tp_cuda");
        assert_eq!(snake_case("LocalRankTest"), "local_rank_test");
        assert_eq!(
            snake_case("FaultyAgentDistAutogradTest"),
            "faulty_agent_dist_autograd_test"
        );
    }
}
