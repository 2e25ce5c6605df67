//! Compile-fail snapshots: misuse of the guest macros gives spanned errors.
//! Regenerate the `.stderr` files with `TRYBUILD=overwrite`.

#[test]
fn misuse_is_reported_with_spans() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
