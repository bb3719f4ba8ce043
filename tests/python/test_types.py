"""The zshard package's type hints: mypy finds no error in the package, the
C extension's stub (zshard/_zshard.pyi) says what the built module has, and
every public function and method of zshard and zshard.torch is annotated.

mypy and stubtest run from Debian's python3-mypy under /usr/bin/python3, the
interpreter whose torch 1.13 the package is checked against; the mypy cache
goes into the build tree, never the source tree."""

import inspect
import os
import subprocess
import sys

import pytest

SOURCE = os.environ.get("ZS_SOURCE_DIR",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PACKAGE_DIR = os.path.join(SOURCE, "client", "python")
BUILD_PYTHON = os.environ.get("ZSHARD_PYTHONPATH",
                              os.path.join(SOURCE, "build", "python"))
CACHE = os.path.join(BUILD_PYTHON, "..", "mypy-cache")
# A first run reads torch's hints (about a minute on two cores); later ones
# use the cache.
TIMEOUT_S = 500

sys.path.insert(0, BUILD_PYTHON)
import zshard  # noqa: E402
import zshard.torch  # noqa: E402


def run(args, cwd, env=None):
    p = subprocess.run([sys.executable, "-m"] + args, cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    return p.returncode, p.stdout + p.stderr


def test_mypy_finds_no_error_in_the_package():
    rc, out = run(["mypy", "--config-file", "mypy.ini", "--cache-dir", CACHE, "-p", "zshard"],
                  cwd=PACKAGE_DIR)
    assert rc == 0, out


def test_the_stub_matches_the_built_extension():
    """stubtest imports the built zshard._zshard and compares every name,
    class and constant with _zshard.pyi (the build tree's copy, which CMake
    copies from the source)."""
    env = dict(os.environ, PYTHONPATH=BUILD_PYTHON)
    rc, out = run(["mypy.stubtest", "--mypy-config-file", os.path.join(PACKAGE_DIR, "mypy.ini"),
                   "zshard._zshard"], cwd=BUILD_PYTHON, env=env)
    assert rc == 0, out


def unannotated(fn):
    """The parameters of `fn` without an annotation, and 'return' if its
    return type is missing (self and cls need none)."""
    sig = inspect.signature(fn)
    missing = [n for n, p in sig.parameters.items()
               if n not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def public_callables(module):
    """(qualified name, function) for every function of module.__all__ and
    every public method or property of its classes defined in Python."""
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            yield "%s.%s" % (module.__name__, name), obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield "%s.%s.%s" % (module.__name__, name, attr), member


@pytest.mark.parametrize("module", [zshard, zshard.torch], ids=lambda m: m.__name__)
def test_every_public_function_is_annotated(module):
    missing = {name: m for name, fn in public_callables(module) if (m := unannotated(fn))}
    assert not missing, missing


@pytest.mark.parametrize("module", [zshard, zshard.torch], ids=lambda m: m.__name__)
def test_all_names_exist(module):
    assert [n for n in module.__all__ if not hasattr(module, n)] == []
