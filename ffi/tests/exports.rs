//! `libtutti.so` exports only `tutti_*` symbols, and exactly the functions `include/tutti.h`
//! declares.

mod common;

use std::collections::BTreeSet;
use std::process::Command;

fn exported() -> BTreeSet<String> {
    let lib = common::shared_lib();
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .unwrap_or_else(|e| panic!("running nm (binutils): {e}"));
    assert!(
        out.status.success(),
        "nm failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(|s| s.split('@').next().unwrap_or(s).to_string())
        .collect()
}

/// The functions the header declares: `name(` at the start of a declaration.
fn declared() -> BTreeSet<String> {
    let header = std::fs::read_to_string(common::repo().join("include/tutti.h")).unwrap();
    header
        .lines()
        .filter(|l| !l.trim_start().starts_with('*') && !l.trim_start().starts_with("/*"))
        .filter_map(|l| {
            // `tutti_result tutti_all_reduce(struct tutti_comm *comm,` → the word before `(`.
            let before = &l[..l.find('(')?];
            let name = before.rsplit([' ', '*']).next()?;
            name.starts_with("tutti_").then(|| name.to_string())
        })
        .collect()
}

#[test]
fn only_tutti_symbols_are_exported() {
    let symbols = exported();
    assert!(!symbols.is_empty(), "nm found no exported symbols");
    let foreign: Vec<&String> = symbols
        .iter()
        .filter(|s| !s.starts_with("tutti_"))
        .collect();
    assert!(
        foreign.is_empty(),
        "libtutti.so exports symbols outside the tutti_ namespace: {foreign:?}"
    );
}

#[test]
fn exports_match_the_header() {
    let symbols = exported();
    let declared = declared();
    assert!(
        declared.len() > 20,
        "parsed too few declarations: {declared:?}"
    );
    let missing: Vec<_> = declared.difference(&symbols).collect();
    let undeclared: Vec<_> = symbols.difference(&declared).collect();
    assert!(missing.is_empty(), "declared but not exported: {missing:?}");
    assert!(
        undeclared.is_empty(),
        "exported but not declared: {undeclared:?}"
    );
}
