//! `include/tutti.h` is what cbindgen generates from `ffi/src` and `ffi/cbindgen.toml`, plus the
//! version macros from Cargo.toml. Fails on any difference and leaves the fresh header in
//! `target/tutti.h.generated`; `TUTTI_UPDATE_HEADER=1` writes it to `include/tutti.h` instead.

use std::path::{Path, PathBuf};

fn ffi_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn generate() -> String {
    let dir = ffi_dir();
    let mut config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("reading ffi/cbindgen.toml: {e}"));
    let version = format!(
        "\n#define TUTTI_VERSION_MAJOR {}\n#define TUTTI_VERSION_MINOR {}\n#define TUTTI_VERSION_PATCH {}\n#define TUTTI_VERSION_STRING \"{}\"\n",
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_PATCH"),
        env!("CARGO_PKG_VERSION"),
    );
    config.after_includes = Some(version + "\n" + config.after_includes.as_deref().unwrap_or(""));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen failed on ffi/src: {e}"));
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("cbindgen writes UTF-8")
}

/// The target directory this test was built in (…/target/<profile>/deps/header-… → …/target).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ffi_dir().join("../target"))
}

#[test]
fn header_is_fresh() {
    let fresh = generate();
    let path = ffi_dir().join("../include/tutti.h");
    if std::env::var_os("TUTTI_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &fresh).expect("writing include/tutti.h");
        eprintln!("wrote {}", path.display());
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let out = target_dir().join("tutti.h.generated");
        std::fs::write(&out, &fresh).expect("writing the generated header");
        let diff = std::process::Command::new("diff")
            .arg("-u")
            .arg(&path)
            .arg(&out)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        panic!(
            "include/tutti.h is stale: it differs from what cbindgen generates now ({}).\n\
             Regenerate it with: TUTTI_UPDATE_HEADER=1 cargo test -p tutti-ffi --test header\n{diff}",
            out.display()
        );
    }
}

#[test]
fn header_has_banner_version_and_config_macros() {
    let h = generate();
    assert!(h.contains("do not edit"), "banner");
    assert!(h.contains(&format!(
        "#define TUTTI_VERSION_STRING \"{}\"",
        env!("CARGO_PKG_VERSION")
    )));
    assert!(h.contains("#define TUTTI_CONFIG_INIT"));
    assert!(h.contains("TUTTI_SUCCESS = 0"));
}
