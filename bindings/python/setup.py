"""Builds libtutti from the workspace's ffi crate (release, debug info stripped) into the
package as tutti/libtutti*.so; everything else is in pyproject.toml.

Cargo features: ``xla`` by default (XLA devices through a PJRT plugin, loaded at run time: a
machine without one answers UNAVAILABLE); ``TUTTI_FEATURES`` (comma-separated, such as
``xla,cuda,mpi``) sets them instead: ``cuda`` loads the CUDA driver and NCCL at run time, ``mpi``
links the system's MPI.

The frameworks' glue: where TensorFlow or jax is importable by the Python that builds (``pip
install --no-build-isolation ./bindings/python`` into an environment that has them, as Horovod's
ops are built), the build also compiles tutti.tensorflow's op library and tutti.jax's FFI
handlers against them, into the package (``tutti/_prebuilt``), so no job compiles on first use.
``TUTTI_WITH_TENSORFLOW`` and ``TUTTI_WITH_JAX``: ``1`` makes that compile a must (the build
fails, saying why, where it cannot), ``0`` skips it; unset, a framework that is not importable
is skipped and a compile that fails is a warning (the glue then compiles on first use; pip
shows the warning with ``-v``)."""

import importlib.util
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
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


# (framework module, the variable that asks for its glue, the package module that builds it)
GLUE = [
    ("tensorflow", "TUTTI_WITH_TENSORFLOW", "tutti.tensorflow"),
    ("jax", "TUTTI_WITH_JAX", "tutti.jax"),
]


class BuildPyWithGlue(build_py):
    """build_py, then the frameworks' glue compiled into the built package (see the module
    documentation)."""

    def run(self):
        super().run()
        build_lib = os.path.abspath(self.build_lib)
        into = os.path.join(build_lib, "tutti", "_prebuilt")
        # A build directory outlives builds (pip install --no-build-isolation builds in the
        # source tree): what an earlier build compiled, for other frameworks, goes.
        shutil.rmtree(into, ignore_errors=True)
        for framework, variable, module in GLUE:
            want = os.environ.get(variable, "").strip()
            if want not in ("", "0", "1"):
                raise SystemExit(f"{variable}={want!r}: 1 (compile {module}'s glue), 0 (skip it) or unset")
            if want == "0":
                continue
            if importlib.util.find_spec(framework) is None:
                if want == "1":
                    raise SystemExit(
                        f"{variable}=1, but {framework} is not importable by the Python that builds "
                        f"({sys.executable}): install it first, then pip install --no-build-isolation"
                    )
                continue
            os.makedirs(into, exist_ok=True)
            # The built package, not the source tree, is what compiles (run from build_lib).
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                       PYTHONPATH=os.pathsep.join(p for p in (build_lib, os.environ.get("PYTHONPATH")) if p))
            code = f"import sys, {module} as m; print(m.build(into=sys.argv[1]))"
            done = subprocess.run([sys.executable, "-c", code, into], cwd=build_lib, env=env,
                                  capture_output=True, text=True)
            if done.returncode == 0:
                print(f"tutti: compiled {module}'s glue against the installed {framework}: "
                      f"{done.stdout.strip().splitlines()[-1]}")
                continue
            why = (done.stderr.strip() or done.stdout.strip())[-4000:]
            if want == "1":
                raise SystemExit(f"{variable}=1, but compiling {module}'s glue failed:\n{why}")
            print(f"warning: tutti: {module}'s glue was not compiled at install (it compiles on "
                  f"first use instead): {why}", file=sys.stderr)


setup(
    cmdclass={"bdist_wheel": PlatformWheel, "build_py": BuildPyWithGlue},
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
