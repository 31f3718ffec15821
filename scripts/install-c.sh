#!/usr/bin/env bash
# Install tutti's C library for C and C++ projects: builds tutti-ffi and puts under a prefix
#
#   lib/libtutti.so, lib/libtutti.a       the C ABI (shared and static)
#   include/tutti.h, include/tutti.hpp    the C header and the header-only C++17 wrapper
#   lib/cmake/tutti/tuttiConfig.cmake     find_package(tutti): imported targets tutti::tutti
#   lib/cmake/tutti/tuttiConfigVersion.cmake  (shared) and tutti::tutti_static
#   lib/pkgconfig/tutti.pc                pkg-config --cflags --libs tutti
#
#   scripts/install-c.sh --prefix DIR [--profile release] [--no-build]
#
# --profile is the cargo profile (default release; dev reads target/debug); --no-build installs
# what the last build of tutti-ffi in that profile left (CARGO_TARGET_DIR is honoured).
# The installed files name no absolute path: the CMake package and tutti.pc find the prefix from
# their own location, so the prefix may be moved or packaged after installing. libtutti.so has
# no SONAME: programs record it as libtutti.so and find it at run time through their rpath or
# LD_LIBRARY_PATH (README, "C API").
set -euo pipefail

usage() { # exit-status: the comment above, on stdout for --help and on stderr otherwise
    if [ "$1" = 0 ]; then
        sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    else
        sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
    fi
    exit "$1"
}

prefix=""
profile=release
build=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || { echo "install-c.sh: --prefix needs a directory" >&2; exit 2; }
            prefix=$2; shift 2 ;;
        --prefix=*) prefix=${1#--prefix=}; shift ;;
        --profile) [ $# -ge 2 ] || { echo "install-c.sh: --profile needs a name" >&2; exit 2; }
            profile=$2; shift 2 ;;
        --profile=*) profile=${1#--profile=}; shift ;;
        --no-build) build=0; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install-c.sh: unknown argument '$1'" >&2; usage 2 ;;
    esac
done
[ -n "$prefix" ] || { echo "install-c.sh: --prefix DIR is required" >&2; usage 2; }

repo=$(cd "$(dirname "$0")/.." && pwd)
target_dir=${CARGO_TARGET_DIR:-$repo/target}
case "$target_dir" in /*) ;; *) target_dir="$repo/$target_dir" ;; esac
case "$profile" in
    dev) out="$target_dir/debug" ;;
    *) out="$target_dir/$profile" ;;
esac

if [ "$build" = 1 ]; then
    # The workspace's libraries, not `-p tutti-ffi` alone: cargo then resolves the
    # dependencies' features as `cargo build` and `cargo run` of the workspace do (the tutti
    # command's clap turns on more of them), so the tutti library built for one serves both.
    (cd "$repo" && cargo build --profile "$profile" --workspace --lib)
fi

case "$(uname -s)" in
    Darwin) shared=libtutti.dylib ;;
    *) shared=libtutti.so ;;
esac
for f in "$out/$shared" "$out/libtutti.a"; do
    [ -f "$f" ] || { echo "install-c.sh: $f is missing: build with cargo build --profile $profile --workspace --lib" >&2; exit 1; }
done

# The version: the workspace's (Cargo.toml, [workspace.package]); the header must agree.
version=$(awk '/^\[/ { in_ws = ($0 == "[workspace.package]") }
               in_ws && /^version *=/ { gsub(/.*= *"|".*/, ""); print; exit }' "$repo/Cargo.toml")
case "$version" in
    [0-9]*.[0-9]*.[0-9]*) ;;
    *) echo "install-c.sh: no version = \"X.Y.Z\" under [workspace.package] in $repo/Cargo.toml" >&2; exit 1 ;;
esac
grep -q "^#define TUTTI_VERSION_STRING \"$version\"" "$repo/include/tutti.h" || {
    echo "install-c.sh: include/tutti.h is not version $version: regenerate it (README, C API)" >&2
    exit 1
}

# The system libraries libtutti.a needs: the Rust standard library's, as this rustc prints them
# for a static library (tutti's dependencies add none: on Linux `cargo rustc -p tutti-ffi --release
# --crate-type staticlib -- --print native-static-libs` prints the same list, and CI links a
# program against the installed libtutti.a with exactly these).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
: >"$scratch/empty.rs"
natives=$(cd "$scratch" && "${RUSTC:-rustc}" --crate-type staticlib --crate-name empty \
    --print native-static-libs -o "$scratch/libempty.a" empty.rs 2>&1 \
    | sed -n 's/.*native-static-libs: *//p')
[ -n "$natives" ] || { echo "install-c.sh: ${RUSTC:-rustc} printed no native-static-libs" >&2; exit 1; }
pointer_bytes=$(( $("${RUSTC:-rustc}" --print cfg | sed -n 's/^target_pointer_width="\([0-9]*\)"/\1/p') / 8 ))
# For CMake: -lNAME is NAME, anything else as it is.
cmake_natives=""
for flag in $natives; do
    case "$flag" in
        -l*) item=${flag#-l} ;;
        *) item=$flag ;;
    esac
    cmake_natives="${cmake_natives:+$cmake_natives;}$item"
done

mkdir -p "$prefix/lib/cmake/tutti" "$prefix/lib/pkgconfig" "$prefix/include"
install -m 755 "$out/$shared" "$prefix/lib/$shared"
install -m 644 "$out/libtutti.a" "$prefix/lib/libtutti.a"
install -m 644 "$repo/include/tutti.h" "$prefix/include/tutti.h"
install -m 644 "$repo/bindings/cpp/tutti.hpp" "$prefix/include/tutti.hpp"

cat >"$prefix/lib/cmake/tutti/tuttiConfig.cmake" <<EOF
# tutti $version, installed by scripts/install-c.sh.
#
#   find_package(tutti $version REQUIRED)
#   target_link_libraries(app PRIVATE tutti::tutti)         # lib/$shared
#   target_link_libraries(app PRIVATE tutti::tutti_static)  # lib/libtutti.a and the system
#                                                           # libraries it needs
#
# Both give include/ (tutti.h, and tutti.hpp for C++17). Every path is found from this file's
# own directory, <prefix>/lib/cmake/tutti, so the prefix may move.
if(CMAKE_VERSION VERSION_LESS 3.9)
  message(FATAL_ERROR "tutti's CMake package needs CMake 3.9 or newer")
endif()
get_filename_component(_tutti_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)

if(NOT TARGET tutti::tutti)
  add_library(tutti::tutti SHARED IMPORTED)
  # The library has no SONAME: CMake links it as -ltutti with -L, so programs record the name
  # $shared (not this path) and find it through their rpath or LD_LIBRARY_PATH. It links its
  # own system libraries, so it passes none on.
  set_target_properties(tutti::tutti PROPERTIES
    IMPORTED_LOCATION "\${_tutti_prefix}/lib/$shared"
    IMPORTED_NO_SONAME TRUE
    INTERFACE_INCLUDE_DIRECTORIES "\${_tutti_prefix}/include")
endif()
if(NOT TARGET tutti::tutti_static)
  add_library(tutti::tutti_static STATIC IMPORTED)
  # rustc --print native-static-libs: $natives
  set_target_properties(tutti::tutti_static PROPERTIES
    IMPORTED_LOCATION "\${_tutti_prefix}/lib/libtutti.a"
    INTERFACE_INCLUDE_DIRECTORIES "\${_tutti_prefix}/include"
    INTERFACE_LINK_LIBRARIES "$cmake_natives")
endif()

set(tutti_INCLUDE_DIRS "\${_tutti_prefix}/include")
set(tutti_LIBRARIES tutti::tutti)
unset(_tutti_prefix)
EOF

cat >"$prefix/lib/cmake/tutti/tuttiConfigVersion.cmake" <<EOF
# tutti $version. Compatible: the same major version and, while it is 0, the same minor version
# (Cargo's rule for 0.x), and not older than asked; a library of the consumer's pointer size.
set(PACKAGE_VERSION "$version")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
set(PACKAGE_VERSION_EXACT FALSE)
if(NOT PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif(NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  if("\${PACKAGE_FIND_VERSION_MAJOR}" STREQUAL "$(echo "$version" | cut -d. -f1)")
    if(NOT PACKAGE_FIND_VERSION_MAJOR EQUAL 0
       OR "\${PACKAGE_FIND_VERSION_MINOR}" STREQUAL "$(echo "$version" | cut -d. -f2)")
      set(PACKAGE_VERSION_COMPATIBLE TRUE)
    endif()
  endif()
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
if(CMAKE_SIZEOF_VOID_P AND NOT CMAKE_SIZEOF_VOID_P STREQUAL "$pointer_bytes")
  set(PACKAGE_VERSION "\${PACKAGE_VERSION} ($((pointer_bytes * 8))-bit)")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
EOF

cat >"$prefix/lib/pkgconfig/tutti.pc" <<EOF
# tutti $version, installed by scripts/install-c.sh; the prefix is found from this file's place.
prefix=\${pcfiledir}/../..
exec_prefix=\${prefix}
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: tutti
Description: Embeddable collective-communication runtime (C ABI; tutti.hpp for C++17)
Version: $version
Libs: -L\${libdir} -ltutti
Libs.private: $natives
Cflags: -I\${includedir}
EOF

echo "installed tutti $version under $prefix"
