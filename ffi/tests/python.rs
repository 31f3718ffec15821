//! The Python bindings' pytest suite (bindings/python/tests), against this build's
//! `libtutti.so`. Skipped, saying why, where python3, numpy or pytest is missing; `.ci/run`
//! installs numpy and pytest and runs it with `TUTTI_REQUIRE_PYTHON=1`, which turns a skip into a
//! failure.

mod common;

use std::process::Command;

#[test]
fn python_bindings_pytest() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let required = std::env::var_os("TUTTI_REQUIRE_PYTHON").is_some();
    let skip = |why: String| {
        assert!(!required, "TUTTI_REQUIRE_PYTHON is set but {why}");
        eprintln!("SKIPPED python_bindings_pytest: {why}");
    };
    let probe = Command::new(&python)
        .args(["-c", "import numpy, pytest"])
        .output();
    match probe {
        Err(e) => return skip(format!("{python} is not runnable ({e})")),
        Ok(o) if !o.status.success() => {
            return skip(format!(
                "{python} lacks numpy or pytest (python3 -m pip install numpy pytest): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
        Ok(_) => {}
    }
    let lib = common::shared_lib();
    let tests = common::repo().join("bindings/python/tests");
    let out = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&tests)
        .env("TUTTI_LIBRARY", &lib)
        .output()
        .expect("running pytest");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "pytest failed:\n{text}");
    println!("{text}");
}
