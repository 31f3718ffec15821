//! Locating the built libraries and compiling and running C and C++ programs against them.
#![allow(dead_code)] // Each test binary uses its own part of this module.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("ffi/ has a parent")
        .to_path_buf()
}

/// The directory cargo put this test's libraries in: the test runs from
/// `target/<profile>/deps/`, and `libtutti.a` and `libtutti.so` sit in `target/<profile>/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test runs from target/<profile>/deps");
    dir.to_path_buf()
}

/// Build `libtutti.a` and `libtutti.so` with the profile and target directory of this test,
/// once per test binary: cargo builds a package's library before its integration tests only
/// when the tests can link it, which a cdylib and staticlib-only crate's tests cannot.
///
/// The build takes the whole workspace's libraries and one small test (`layers`, which has the
/// dev-dependencies), so that cargo resolves the dependencies' features as `cargo test` of the
/// workspace does: `tutti` and its dependencies built for the tests are reused, where
/// `-p tutti-ffi --lib` alone would build them again with other features (clap's derive turns
/// on `syn`'s `full`, which rebuilds every derive and the crates that use them).
fn ensure_built() {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let result = BUILT.get_or_init(|| {
        let dir = profile_dir();
        let profile = dir.file_name().and_then(|p| p.to_str()).unwrap_or("debug");
        let target_dir = dir.parent().expect("target/<profile> has a parent");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(&cargo);
        cmd.args([
            "build",
            "--quiet",
            "--workspace",
            "--lib",
            "--test",
            "layers",
        ]);
        // The library gets the features these tests were built with.
        if cfg!(feature = "xla") {
            cmd.args(["--features", "tutti-ffi/xla"]);
        }
        cmd.arg("--target-dir").arg(target_dir).current_dir(repo());
        match profile {
            "debug" => {}
            "release" => {
                cmd.arg("--release");
            }
            other => {
                cmd.args(["--profile", other]);
            }
        }
        let out = cmd.output().map_err(|e| format!("running {cargo}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{cmd:?} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    });
    if let Err(e) = result {
        panic!("building the C libraries: {e}");
    }
}

/// `libtutti.a`, freshly built.
pub fn static_lib() -> PathBuf {
    ensure_built();
    let p = profile_dir().join("libtutti.a");
    assert!(p.exists(), "{} is missing after the build", p.display());
    p
}

/// `libtutti.so`, freshly built.
pub fn shared_lib() -> PathBuf {
    ensure_built();
    let p = profile_dir().join("libtutti.so");
    assert!(p.exists(), "{} is missing after the build", p.display());
    p
}

/// What a program linked against `libtutti.a` also needs (`rustc --print native-static-libs`).
pub const NATIVE_LIBS: &[&str] = &["-lpthread", "-ldl", "-lm", "-lrt", "-lutil"];

/// Extra compiler flags from `TUTTI_CFLAGS` (the sanitizer pass of `.ci/run` sets
/// `-fsanitize=address -fno-omit-frame-pointer`).
pub fn extra_flags() -> Vec<String> {
    std::env::var("TUTTI_CFLAGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// Where compiled programs go: separate directories for separate flags.
fn out_dir() -> PathBuf {
    let flags: String = extra_flags()
        .join("")
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let name = if flags.is_empty() {
        "c-api-tests".to_string()
    } else {
        format!("c-api-tests-{flags}")
    };
    let d = profile_dir().join(name);
    std::fs::create_dir_all(&d).expect("creating the test output directory");
    d
}

pub enum Lang {
    C,
    Cxx,
}

/// Compile `sources` (relative to the repository root) into a program named `name`, linked
/// against `libtutti.a`, with every warning an error. Panics with the compiler's output.
pub fn compile(lang: Lang, name: &str, sources: &[&str], include_dirs: &[&str]) -> PathBuf {
    let repo = repo();
    let (compiler, std) = match lang {
        Lang::C => (
            std::env::var("CC").unwrap_or_else(|_| "cc".into()),
            "-std=c11",
        ),
        Lang::Cxx => (
            std::env::var("CXX").unwrap_or_else(|_| "c++".into()),
            "-std=c++17",
        ),
    };
    let out = out_dir().join(name);
    let mut cmd = Command::new(&compiler);
    cmd.args([std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-g"]);
    cmd.arg(format!("-I{}", repo.join("include").display()));
    for d in include_dirs {
        cmd.arg(format!("-I{}", repo.join(d).display()));
    }
    cmd.args(extra_flags());
    for s in sources {
        cmd.arg(repo.join(s));
    }
    cmd.arg(static_lib()).args(NATIVE_LIBS).arg("-o").arg(&out);
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {compiler}: {e} (a C compiler is needed)"));
    assert!(
        output.status.success(),
        "compiling {sources:?} failed:\n{:?}\n{}{}",
        cmd,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    out
}

/// Run a program with a time limit; panics with its output unless it exits 0. Returns stdout.
pub fn run(program: &Path, envs: &[(&str, &str)], limit: Duration) -> String {
    let mut child = Command::new(program)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for the program") {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collecting output");
            panic!(
                "{} ran past {limit:?} and was killed\nstdout:\n{}\nstderr:\n{}",
                program.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().expect("collecting output");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        status.success(),
        "{} failed ({status})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        program.display()
    );
    print!("{stdout}");
    eprint!("{stderr}");
    stdout
}
