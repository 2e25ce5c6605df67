//! The seed tests that have no Rust test, each with its reason, read from
//! the two tables `cargo xtask coverage` reads too (one place for both):
//! `tests/support/not_applicable.tsv` (no port by decision: python-only,
//! ruled out by Rust's types, one backend) and the test rows of
//! `tests/support/not_yet_ported.tsv` (planned work). `rpc_test::seed_coverage`
//! checks them against the list of seed tests (`seed-tests.tsv`): every
//! seed test of the checked areas is either a test of the same name or
//! listed, never both.

/// The tests of seed file `seed_file` listed in either table, with their
/// reasons (a test listed under several suites appears once per suite).
pub fn unported(seed_file: &str) -> Vec<(&'static str, &'static str)> {
    let rows = |text: &'static str, test_column: usize, reason_column: usize| {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(move |l| {
                let f: Vec<&'static str> = l.splitn(reason_column + 1, '\t').collect();
                (f.len() > reason_column).then(|| (f[0], f[test_column], f[reason_column]))
            })
    };
    rows(include_str!("not_applicable.tsv"), 2, 3)
        .chain(rows(include_str!("not_yet_ported.tsv"), 1, 2))
        .filter(|(file, test, _)| *file == seed_file && test.starts_with("test_"))
        .map(|(_, test, why)| (test, why))
        .collect()
}
