"""The package's C++ CPU extensions: compiled when the package is installed, loaded at
engine start, never compiled by an engine.

`python -m pagefleet_kernels.cpu_build` (run by `make install` and by the serving image's
build) compiles each extension (`EXTENSIONS`) for the CPU families it is asked for into the
prebuilt folder (`pagefleet_kernels/prebuilt/`, or $PAGEFLEET_KERNELS_DIR). Each object is
named by its family and a digest of its sources, flags and torch version, and sits next to a
JSON record of the CPU flags it needs. `load_extension` imports the best family this CPU's
flags allow among the objects built from these very sources; when there is none it says so
once and returns None, and the engine uses the torch kernels. An engine start, and a fortiori
a request, never waits for a compiler.

The families (`FAMILIES`): `avx512` (x86-64-v4), `avx2` (x86-64-v3), `generic` (the
compiler's default target: any CPU of its architecture, arm64 included), and `native`
(-march=native: for a local build that asks for it; it records the building CPU's flags and
loads only on a CPU that has every one of them). A family's object is preferred over the
ones after it in that order (native first).

Every build runs in a fresh temporary folder and the finished object is moved into place
whole, so a build killed half-way leaves nothing behind that a later build or an engine
would wait on (torch's JIT builds share a folder with a lock file, which a killed build left
in place: every later start waited on it for ever).

Every extension is built with -fopenmp: ATen's `at::parallel_for` is a header template
that runs its loop on one thread unless the file that includes it is compiled with OpenMP
(torch's own libgomp is already loaded in the process, so the extension joins its thread
pool). Built without it, the attention kernel ran on one thread whatever
`torch.set_num_threads` said: a batch-64 decode call took as long with two threads as with one.

And with -fno-trapping-math, which changes no result: GCC vectorizes `std::nearbyint` (the
exp of the softmax, SiLU and GELU) only when it may ignore floating-point traps, and
otherwise leaves those loops scalar (vroundss, a lane at a time).
"""

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")


@dataclass(frozen=True)
class Extension:
    name: str
    sources: tuple[str, ...]  # in csrc/, compiled with the shared headers of csrc/
    flags: tuple[str, ...]


EXTENSIONS = {
    # -ffast-math for the reductions' vectorization; NaN/inf checks stay meaningful.
    "pagefleet_paged_attention_cpu": Extension(
        "pagefleet_paged_attention_cpu",
        ("paged_attention_cpu.cpp",),
        ("-ffast-math", "-fno-finite-math-only"),
    ),
    "pagefleet_layer_ops_cpu": Extension(
        "pagefleet_layer_ops_cpu",
        ("layer_ops_cpu.cpp", "quant_matmul_cpu.cpp"),
        ("-ffp-contract=off",),
    ),
}

# x86-64 microarchitecture levels as /proc/cpuinfo spells their features (abm: lzcnt).
_X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Family:
    name: str
    flags: tuple[str, ...]
    requires: frozenset[str] | None  # None: the building CPU's flags (native)
    machines: tuple[str, ...]  # platform.machine() values it can be built on; () any


FAMILIES = {
    family.name: family
    for family in (
        Family("native", ("-march=native",), None, ()),
        Family("avx512", ("-march=x86-64-v4",), _X86_64_V4, ("x86_64", "AMD64")),
        Family("avx2", ("-march=x86-64-v3",), _X86_64_V3, ("x86_64", "AMD64")),
        Family("generic", (), frozenset(), ()),
    )
}


def prebuilt_dir() -> Path:
    return Path(os.environ.get("PAGEFLEET_KERNELS_DIR") or Path(__file__).parent / "prebuilt")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux: /proc/cpuinfo's `flags`, `Features` on arm64);
    empty where they cannot be read, which leaves only the generic family."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def fits(family: Family, flags: frozenset[str]) -> bool:
    """Whether a named family's objects run on a CPU with these flags (native's flags are
    recorded at its build)."""
    machine = platform.machine()
    return (not family.machines or machine in family.machines) and (
        family.requires is None or family.requires <= flags
    )


def best_family(flags: frozenset[str]) -> Family:
    """The best named family (not native) for a CPU with these flags."""
    return next(f for f in FAMILIES.values() if f.requires is not None and fits(f, flags))


def _module_name(extension: Extension, family: Family) -> str:
    import torch

    flags = [*BASE_FLAGS, *family.flags, *extension.flags]
    digest = hashlib.sha256(f"{torch.__version__} {' '.join(flags)}".encode())
    for path in [*(CSRC / source for source in extension.sources), *sorted(CSRC.glob("*.h"))]:
        digest.update(path.read_bytes())
    return f"{extension.name}_{family.name}_{digest.hexdigest()[:12]}"


def _object_path(module: str) -> Path:
    return prebuilt_dir() / f"{module}{sysconfig.get_config_var('EXT_SUFFIX')}"


@functools.cache
def load_extension(name: str):
    """The compiled module of extension `name` for this CPU, or None when none was built
    for it from these sources (the caller uses torch)."""
    extension = EXTENSIONS[name]
    flags = cpu_flags()
    for family in FAMILIES.values():
        module = _module_name(extension, family)
        record = prebuilt_dir() / f"{module}.json"
        if not record.exists():
            continue
        requires = frozenset(json.loads(record.read_text())["requires"])
        if requires <= flags and fits(family, flags):
            logger.info("C++ extension %s: the %s build", name, family.name)
            return _import(module, _object_path(module))
    logger.warning(
        "no C++ extension %s built for this CPU (%s) from these sources in %s: the torch "
        "kernels are used instead; `python -m pagefleet_kernels.cpu_build` builds it",
        name,
        best_family(flags).name,
        prebuilt_dir(),
    )
    return None


def _import(module: str, path: Path):
    import torch  # noqa: F401 (the object links against torch's libraries: loaded first)

    spec = importlib.util.spec_from_file_location(module, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def build(name: str, family_name: str) -> Path:
    """Compile extension `name` for one family into the prebuilt folder (a no-op when its
    object for these sources is there) and drop that family's objects of older sources.
    Raises when the compiler fails. The object is not imported: an AVX-512 build may be
    made on a CPU that cannot run it."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    extension, family = EXTENSIONS[name], FAMILIES[family_name]
    module = _module_name(extension, family)
    target, record = _object_path(module), prebuilt_dir() / f"{module}.json"
    if target.exists() and record.exists():
        return target
    prebuilt_dir().mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix=f".{module}-", dir=prebuilt_dir()) as scratch,
        contextlib.chdir(scratch),  # setuptools reads the working directory's pyproject.toml
    ):
        setup(
            name=module,
            ext_modules=[
                CppExtension(
                    module,
                    [str(CSRC / source) for source in extension.sources],
                    include_dirs=[str(CSRC)],
                    extra_compile_args=[*BASE_FLAGS, *family.flags, *extension.flags],
                    extra_link_args=["-fopenmp"],
                )
            ],
            cmdclass={"build_ext": BuildExtension},
            script_args=[
                "--quiet",
                "build_ext",
                f"--build-lib={scratch}",
                f"--build-temp={scratch}/temp",
            ],
        )
        os.replace(Path(scratch) / target.name, target)
        requires = cpu_flags() if family.requires is None else family.requires
        draft = Path(scratch) / record.name
        draft.write_text(
            json.dumps({"extension": name, "family": family.name, "requires": sorted(requires)})
        )
        os.replace(draft, record)
    for old in prebuilt_dir().glob(f"{extension.name}_{family.name}_*"):
        if not old.name.startswith(module):
            old.unlink(missing_ok=True)
    return target


def _build_in_child(name: str, family: str) -> str:
    try:
        return str(build(name, family))
    except SystemExit as exc:  # setuptools exits on a compiler error
        raise RuntimeError(f"the compiler failed ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagefleet_kernels.cpu_build",
        description="Compile the C++ CPU extensions ahead of time, for the CPU families "
        "named, into the package's prebuilt folder (or $PAGEFLEET_KERNELS_DIR).",
    )
    parser.add_argument(
        "--families",
        default="auto",
        help="comma-separated, of " + ", ".join(FAMILIES) + "; 'auto' (default): the best "
        "named family this CPU runs (native only when named)",
    )
    args = parser.parse_args(argv)
    names = [f.strip() for f in args.families.split(",") if f.strip()]
    if names == ["auto"]:
        names = [best_family(cpu_flags()).name]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(
            f"unknown CPU famil{'ies' if len(unknown) > 1 else 'y'} {unknown}: "
            f"choose from {', '.join(FAMILIES)}"
        )
    unbuildable = [
        n for n in names if FAMILIES[n].machines and platform.machine() not in FAMILIES[n].machines
    ]
    if unbuildable:
        parser.error(f"{', '.join(unbuildable)} cannot be built on {platform.machine()}")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        print("no C++ compiler (c++ or $CXX) on PATH: install g++", file=sys.stderr)
        return 1
    jobs = [(extension, family) for extension in EXTENSIONS for family in names]
    failed = []
    # One compiler process per job, as many at once as there are cores.
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=get_context("spawn")) as pool:
        futures = {job: pool.submit(_build_in_child, *job) for job in jobs}
        for (extension, family), future in futures.items():
            try:
                print(f"{extension} ({family}): {future.result()}")
            except Exception as exc:  # noqa: BLE001 - the compiler's own output is above
                failed.append(f"{extension} ({family}): {exc}")
    for line in failed:
        print(f"build failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
