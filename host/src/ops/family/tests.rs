//! Tests of `family`.

use super::*;

#[test]
fn in_place_forms_belong_to_families_that_take_them() {
    let arithmetic = family("arithmetic").unwrap();
    assert!(arithmetic.contains("aten", "add"));
    assert!(arithmetic.contains("aten", "add_"));
    assert!(!arithmetic.contains("aten", "add__"));
    assert!(!arithmetic.contains("prim", "add"));
    let creation = family("creation").unwrap();
    assert!(creation.contains("aten", "zeros"));
    assert!(!creation.contains("aten", "zeros_"));
    assert!(family("builtins").unwrap().contains("builtins", "min"));
    assert!(family("nope").is_none());
}

#[test]
fn family_names_and_members_are_unique() {
    let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), FAMILIES.len());
    let mut members: Vec<String> = FAMILIES.iter().flat_map(Family::member_names).collect();
    let all = members.len();
    members.sort();
    members.dedup();
    assert_eq!(members.len(), all, "a member is listed in two families");
}
