//! The library's modules form layers, and a layer imports only the layers below it: the README's
//! layout, checked. Every `crate::module` a source file names outside comments counts, and every
//! top-level module must have a layer, so a new module is placed when it is added. A file's unit
//! tests (a top-level `#[cfg(test)] mod … { … }`) are not the library: they may drive their
//! layer through the ones above it (a rule of `cluster` checked through every way of joining).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Lowest first. A module may import the modules of the layers before its own, never its own
/// layer's others or the ones after.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["sync", "dtype", "reuse"],
    &["call", "cluster", "reference"],
    &["transport", "tuning"],
    &["algorithm"],
    &["config", "trace"],
    // CPU, CUDA and PJRT devices: discovery, libraries, buffers.
    &["device"],
    // What runs a checked call on a group of devices (NCCL, the CUDA copies, PJRT programs).
    &["engine"],
    // The public faces of device/cuda + engine/cuda and device/pjrt + engine/pjrt.
    &["gpu", "xla"],
    &["comm"],
    &["strategy", "perf"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a line names as `crate::m` or `crate::{m, n::…}`.
fn named_modules(line: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (i, _) in line.match_indices("crate::") {
        let rest = &line[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group: split at commas outside nested braces.
            let mut depth = 0;
            let mut start = 0;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(ident(&group[start..j]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident(&group[start..j]));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest));
        }
    }
    out
}

#[test]
fn layers_import_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();

    // Each file with the top-level module it belongs to (`src/a.rs` and `src/a/…` are `a`).
    let tops: Vec<String> = files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(&src).unwrap();
            let first = rel.components().next().unwrap().as_os_str();
            first.to_str().unwrap().trim_end_matches(".rs").to_string()
        })
        .collect();
    let modules: BTreeSet<&str> = tops
        .iter()
        .map(String::as_str)
        .filter(|&t| t != "lib")
        .collect();
    let unplaced: Vec<_> = modules.iter().filter(|m| layer_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "modules without a layer in tests/layers.rs: {unplaced:?}"
    );

    let mut wrong = Vec::new();
    for (f, top) in files.iter().zip(&tops) {
        let rel = f.strip_prefix(&src).unwrap();
        let Some(own) = layer_of(top) else { continue };
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut in_tests = false;
        for (n, line) in lines.iter().enumerate() {
            // A top-level test module runs from `#[cfg(test)]` over `mod name {` to the `}`
            // that closes it at the start of a line.
            if !in_tests
                && *line == "#[cfg(test)]"
                && lines
                    .get(n + 1)
                    .is_some_and(|l| l.starts_with("mod ") && l.ends_with('{'))
            {
                in_tests = true;
            }
            if in_tests {
                in_tests = *line != "}";
                continue;
            }
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for m in named_modules(code) {
                if m == *top || !modules.contains(m.as_str()) {
                    continue;
                }
                if layer_of(&m).unwrap() >= own {
                    wrong.push(format!(
                        "src/{}:{}: {top} imports {m}",
                        rel.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports of a layer not below the importer's:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_sees_both_forms() {
    assert_eq!(named_modules("use crate::comm::Config;"), ["comm"]);
    assert_eq!(
        named_modules("use crate::{dtype::{DType, ReduceOp}, error::Error};"),
        ["dtype", "error"]
    );
    assert_eq!(
        named_modules("let a = crate::gpu::x(crate::xla::y);"),
        ["gpu", "xla"]
    );
}
