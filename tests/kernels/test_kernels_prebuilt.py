"""The C++ CPU extensions are built ahead of time and loaded by CPU family, never compiled
by an engine (`pagefleet_kernels.cpu_build`)."""

import json
import logging
import shutil

import pytest
from pagefleet_kernels import cpu_attention, cpu_build, cpu_layer_ops
from pagefleet_kernels.cpu_build import FAMILIES, best_family, fits

V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm", "sse4_2"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86 = cpu_build.platform.machine() in ("x86_64", "AMD64")


def test_both_extensions_are_built_for_this_cpu():
    """`make install` builds them (and fails when it cannot): an extension missing must
    fail the run, not turn every C++ kernel test into a skip."""
    hint = "run `python -m pagefleet_kernels.cpu_build` (make install does)"
    assert cpu_attention.available(), f"the C++ attention kernel is not built: {hint}"
    assert cpu_layer_ops.available(), f"the C++ layer ops are not built: {hint}"


@pytest.mark.skipif(not X86, reason="the x86-64 families")
def test_the_family_chosen_is_the_best_the_cpus_flags_allow():
    assert best_family(frozenset(V4)).name == "avx512"
    assert best_family(frozenset(V3)).name == "avx2"
    assert best_family(frozenset(V4 - {"avx512vl"})).name == "avx2"
    assert best_family(frozenset({"sse2"})).name == "generic"
    assert best_family(frozenset()).name == "generic"
    assert not fits(FAMILIES["avx2"], frozenset(V3 - {"fma"}))
    assert fits(FAMILIES["generic"], frozenset())


def copy_prebuilt(tmp_path, monkeypatch):
    """This checkout's prebuilt objects in a folder of the test's own."""
    folder = tmp_path / "prebuilt"
    shutil.copytree(cpu_build.prebuilt_dir(), folder)
    monkeypatch.setenv("PAGEFLEET_KERNELS_DIR", str(folder))
    return folder


def load(name: str):
    """`load_extension` past its cache (the test changes what it would find)."""
    return cpu_build.load_extension.__wrapped__(name)


@pytest.mark.skipif(not cpu_attention.available(), reason="not built for this CPU")
def test_an_object_built_for_flags_this_cpu_lacks_is_passed_over(tmp_path, monkeypatch, caplog):
    folder = copy_prebuilt(tmp_path, monkeypatch)
    name = "pagefleet_paged_attention_cpu"
    # A native build from a CPU with a flag this one lacks comes first in preference.
    native = cpu_build._module_name(cpu_build.EXTENSIONS[name], FAMILIES["native"])
    (folder / f"{native}.json").write_text(
        json.dumps({"extension": name, "family": "native", "requires": ["no_such_flag"]})
    )
    with caplog.at_level(logging.INFO, logger="pagefleet_kernels.cpu_build"):
        module = load(name)
    assert module is not None and "_native_" not in module.__name__
    assert f"C++ extension {name}: the {module.__name__.split('_')[-2]} build" in caplog.text
    assert module.parallel_threads() >= 1  # it runs


@pytest.mark.skipif(not cpu_attention.available(), reason="not built for this CPU")
def test_objects_of_other_sources_are_never_loaded_and_nothing_compiles(
    tmp_path, monkeypatch, caplog
):
    """After the sources change, the old objects' digests no longer match: the engine says
    once that it uses torch, and does not build (a request never waits for a compiler)."""
    folder = copy_prebuilt(tmp_path, monkeypatch)
    for path in folder.iterdir():  # the same objects under another digest
        family, rest = path.name.rsplit("_", 1)
        path.rename(folder / f"{family}_000000000000{rest[12:]}")
    before = sorted(p.name for p in folder.iterdir())
    with caplog.at_level(logging.WARNING, logger="pagefleet_kernels.cpu_build"):
        assert load("pagefleet_layer_ops_cpu") is None
    assert "no C++ extension pagefleet_layer_ops_cpu built for this CPU" in caplog.text
    assert "python -m pagefleet_kernels.cpu_build" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == before


def test_an_empty_prebuilt_folder_means_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_KERNELS_DIR", str(tmp_path))
    assert load("pagefleet_paged_attention_cpu") is None
    assert list(tmp_path.iterdir()) == []


def test_the_builder_refuses_an_unknown_family_with_a_readable_message(capsys):
    with pytest.raises(SystemExit) as exc:
        cpu_build.main(["--families", "avx9000"])
    assert exc.value.code == 2
    assert "unknown CPU family ['avx9000']: choose from native, avx512, avx2, generic" in (
        capsys.readouterr().err
    )


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_a_compiler_error_fails_the_build_and_leaves_no_object(tmp_path, monkeypatch, capsys):
    """`make install` runs this build and CI stops when it fails: a compile error must be
    exit status 1 naming each extension that failed, not 0 with the engine quietly on the
    torch kernels. The compiler is the real one, given a header that does not exist."""
    compiler = tmp_path / "broken-c++"
    compiler.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -c "*) exec c++ "$@" -include pagefleet-no-such-header.h;; esac\n'
        'exec c++ "$@"\n'
    )
    compiler.chmod(0o755)
    folder = tmp_path / "prebuilt"
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("PAGEFLEET_KERNELS_DIR", str(folder))
    assert cpu_build.main(["--families", "generic"]) == 1
    err = capsys.readouterr().err
    for name in cpu_build.EXTENSIONS:
        assert f"build failed: {name} (generic)" in err
        assert load(name) is None  # nothing half-built is left to load
    assert list(folder.iterdir()) == []
