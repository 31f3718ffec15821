"""Builds libtutti from the workspace's ffi crate (release, debug info stripped) into the
package as tutti/libtutti*.so; everything else is in pyproject.toml."""

from setuptools import setup
from setuptools_rust import Binding, RustExtension, Strip

setup(
    rust_extensions=[
        RustExtension(
            "tutti.libtutti",
            path="../../ffi/Cargo.toml",
            binding=Binding.NoBinding,
            strip=Strip.Debug,
            py_limited_api=False,
        )
    ],
)
