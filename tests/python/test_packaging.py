"""Packaging, tried the way a user meets it: what libmok.so exports, `pip install .` into a fresh
virtual environment, `pip wheel .` installed into another one, and an outside CMake project built
with find_package(mok) against an installed tree.

The export check always runs.  The install checks build the library again (with its CUDA part
when nvcc is present: minutes), so they run when MOK_TEST_PACKAGING=1 (test.sh and CI set it)
and skip otherwise.  MOK_PIP_NO_BUILD_ISOLATION=1 builds with the scikit-build-core already
installed (a machine without network access to the package index).
"""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import mok
from mok import _lib

import package_smoke

REPO = Path(__file__).resolve().parents[2]
PACKAGING = os.environ.get("MOK_TEST_PACKAGING") == "1"
needs_packaging = pytest.mark.skipif(not PACKAGING, reason="set MOK_TEST_PACKAGING=1 (test.sh does) to build and install")


def _run(cmd, cwd=None, env=None, timeout=1800):
    """Runs a command; on failure the assertion shows its output."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _clean_env():
    """The environment without the source tree on the path, so the installed package is used."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "MOK_LIBRARY"):
        env.pop(name, None)
    return env


def test_libmok_exports_only_the_c_abi():
    # Whatever the toolchain (a static libstdc++ included), libmok.so exports mok* and nothing
    # else: std:: symbols in its dynamic table collide with the libstdc++ torch loaded.
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed")
    out = _run([nm, "-D", "--defined-only", _lib.lib._name])
    names = [line.split()[-1] for line in out.splitlines() if len(line.split()) >= 2]
    foreign = [n for n in names if not n.startswith("mok")]
    assert not foreign, f"{_lib.lib._name} exports {len(foreign)} symbols outside the C ABI: {foreign[:20]}"
    assert "mokForward" in names and "mokGetDefaultConfig" in names


def _smoke(python, prefix, tmp_path, tag):
    """Runs package_smoke.py with `python` from a directory outside the repository, then the same
    call through the source tree's package in this process; the two must agree bitwise (the CPU
    backend's bits do not depend on the build)."""
    out = tmp_path / f"{tag}.pt"
    workdir = tmp_path / f"{tag}-cwd"
    workdir.mkdir()
    print(_run([python, Path(__file__).with_name("package_smoke.py"), prefix, out], cwd=workdir, env=_clean_env()))
    got = torch.load(out)
    assert got.pop("version") == mok.__version__
    for name, value in package_smoke.run().items():
        assert torch.isfinite(value.float()).all(), name
        assert torch.equal(got[name], value), f"{name} differs between the installed package and the source tree"


def _venv(path: Path) -> Path:
    # --system-site-packages: torch comes from the machine (a fresh torch download is not what
    # is under test); mok itself must come from the venv.
    _run([sys.executable, "-m", "venv", "--system-site-packages", path])
    python = path / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        # This interpreter is itself a venv (torch lives in it, not in the base interpreter's
        # site-packages): hand its packages on with a .pth file, after the new venv's own.
        import site
        parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
        (Path(_site_packages(python)) / "_mok_test_parent.pth").write_text("\n".join(parents) + "\n")
    return python


def _pip_flags():
    flags = ["--no-build-isolation"] if os.environ.get("MOK_PIP_NO_BUILD_ISOLATION") == "1" else []
    return flags


def _site_packages(python: Path) -> str:
    return _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install .` of the repository into a fresh venv: (python, site-packages)."""
    root = tmp_path_factory.mktemp("pip-install")
    python = _venv(root / "venv")
    _run([python, "-m", "pip", "install", "-q", *_pip_flags(), REPO], cwd=root)
    return python, _site_packages(python)


@needs_packaging
def test_pip_install_then_forward_backward_from_another_directory(installed, tmp_path):
    python, site = installed
    assert (Path(site) / "mok" / "lib" / "libmok.so").is_file()
    _smoke(python, site, tmp_path, "pip-install")


@needs_packaging
def test_pip_install_reports_the_cuda_part_it_built(installed):
    python, _ = installed
    has = _run([python, "-c", "import mok; print(int(mok.has_cuda()))"], env=_clean_env()).strip()
    nvcc = shutil.which("nvcc") or (Path("/usr/local/cuda/bin/nvcc") if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    assert has == ("1" if nvcc else "0"), f"has_cuda() = {has} with nvcc = {nvcc}"


@needs_packaging
def test_wheel_installs_into_another_environment(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_pip_flags(), "-w", dist, REPO], cwd=tmp_path)
    wheels = list(dist.glob("mok-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    assert f"mok-{mok.__version__}-py3-none-" in wheel.name, wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    for member in ("mok/__init__.py", "mok/lib/libmok.so", "mok/include/mok/mok.h", "mok/lib/cmake/mok/mokConfig.cmake"):
        assert member in names, f"{member} missing from {wheel.name}"
    # Another environment, the wheel file alone (no source tree, no build folder).
    python = _venv(tmp_path / "other")
    _run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], cwd=tmp_path)
    _smoke(python, _site_packages(python), tmp_path, "wheel")


def _outside_project(prefix: str, tmp_path: Path, tag: str) -> str:
    """Configures, builds and runs tests/package (examples/cpp_layer.cpp via find_package)."""
    build = tmp_path / f"outside-{tag}"
    _run(["cmake", "-S", REPO / "tests" / "package", "-B", build, f"-DCMAKE_PREFIX_PATH={prefix}"])
    _run(["cmake", "--build", build])
    exe = build / "cpp_layer"
    libs = _run(["ldd", exe])
    assert str(Path(prefix).resolve()) in libs or prefix in libs, f"cpp_layer does not load libmok from {prefix}:\n{libs}"
    return _run([exe], cwd=tmp_path)


def _build_dir() -> Path:
    """The CMake build folder of the loaded libmok (<build>/lib/libmok.so)."""
    build = Path(_lib.lib._name).resolve().parent.parent
    if not (build / "CMakeCache.txt").is_file():
        pytest.skip(f"{_lib.lib._name} does not come from a CMake build folder")
    return build


@needs_packaging
def test_find_package_outside_project_against_an_installed_tree(tmp_path):
    prefix = tmp_path / "prefix"
    _run(["cmake", "--install", _build_dir(), "--prefix", prefix])
    assert (prefix / "lib" / "cmake" / "mok" / "mokConfig.cmake").is_file()
    assert (prefix / "include" / "mok" / "mok.h").is_file()
    _outside_project(str(prefix), tmp_path, "install")


@needs_packaging
def test_find_package_against_the_pip_installed_package(installed, tmp_path):
    python, _ = installed
    prefix = _run([python, "-c", "import mok; print(mok.cmake_prefix_path())"], env=_clean_env()).strip()
    _outside_project(prefix, tmp_path, "pip")
