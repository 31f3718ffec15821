"""Builds libtutti from the workspace's ffi crate (release, debug info stripped) into the
package as tutti/libtutti*.so; everything else is in pyproject.toml.

Cargo features: ``xla`` by default (XLA devices through a PJRT plugin, loaded at run time: a
machine without one answers UNAVAILABLE); ``TUTTI_FEATURES`` (comma-separated, such as
``xla,cuda,mpi``) sets them instead: ``cuda`` loads the CUDA driver and NCCL at run time, ``mpi``
links the system's MPI."""

import os

from setuptools import setup
from setuptools_rust import Binding, RustExtension, Strip

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel


class PlatformWheel(bdist_wheel):
    """libtutti is loaded with ctypes, not as an extension module: the wheel fits every
    Python 3 on its platform (py3-none-<platform>), not only the one that built it."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    cmdclass={"bdist_wheel": PlatformWheel},
    rust_extensions=[
        RustExtension(
            "tutti.libtutti",
            path="../../ffi/Cargo.toml",
            binding=Binding.NoBinding,
            features=[f for f in os.environ.get("TUTTI_FEATURES", "xla").replace(" ", "").split(",") if f],
            strip=Strip.Debug,
            py_limited_api=False,
        )
    ],
)
