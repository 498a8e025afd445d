"""What a test run costs, for every test under the repository (tests/ and e2e/).

At the end of a run pytest prints how many `pagefleet serve` processes the run started and
how many engines it built in the test process itself, the two dearest things the suite
does: a change that adds one shows up here before it shows up in the wall clock. With
`--durations-table PATH` it also writes each test file's total time (setup, call and
teardown of its tests, module fixtures included) as a Markdown table, slowest first, with
the servers and engines each file started (`make durations` writes
docs/test-durations.md).

After each test module (its module fixtures torn down) the run collects garbage and hands
the C heap's free pages back to the system (`malloc_trim`): without that an in-process
engine's model and KV pool stayed in the process's memory after the module that built
them, and `make test` runs two such processes at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # tests/test_suite_report.py runs pytest on this file

_counts = {"serve": 0, "engines": 0}
_file_seconds: dict[str, float] = defaultdict(float)
_file_tests: dict[str, int] = defaultdict(int)
# What each file started: a session or module fixture's start counts for the file whose
# test set it up (the first to use it).
_file_counts: dict[str, dict[str, int]] = defaultdict(lambda: {"serve": 0, "engines": 0})
_current_file = [""]
_started = time.monotonic()


def _is_serve_command(args) -> bool:
    """`python -m pagefleet_serve.cli serve ...` (the test harness) or `pagefleet serve ...`
    (the e2e walk's simulated kubelet)."""
    if isinstance(args, (str, bytes)) or args is None:
        return False
    parts = [str(part) for part in args]
    return any(
        (part == "pagefleet_serve.cli" or Path(part).name == "pagefleet") and following == "serve"
        for part, following in itertools.pairwise(parts)
    )


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and _is_serve_command(args[1]):
        _counts["serve"] += 1
        _file_counts[_current_file[0]]["serve"] += 1


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one only counts


def _count_engine_builds() -> None:
    """Wrap LLMEngine.__init__ once the test process has imported it (importing it here would
    load torch for runs that never need it)."""
    module = sys.modules.get("pagefleet_serve.engine.llm_engine")
    engine = getattr(module, "LLMEngine", None)
    if engine is None or getattr(engine.__init__, "_counted", False):
        return
    original = engine.__init__

    def counted_init(self, *args, **kwargs):
        _counts["engines"] += 1
        _file_counts[_current_file[0]]["engines"] += 1
        original(self, *args, **kwargs)

    counted_init._counted = True  # type: ignore[attr-defined]
    engine.__init__ = counted_init


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--durations-table",
        metavar="PATH",
        help="write each test file's total duration as a Markdown table to PATH",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    _count_engine_builds()


def _c_heap_trim():
    """glibc's malloc_trim, or None where the C library has none (not glibc)."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


_malloc_trim = _c_heap_trim()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    module = getattr(item, "module", None)
    if nextitem is None or getattr(nextitem, "module", None) is not module:
        gc.collect()  # the module's engines: their fixtures have just let them go
        if _malloc_trim is not None:
            _malloc_trim(0)
    return result


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _current_file[0] = nodeid.split("::", 1)[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] += report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _file_tests[path] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    terminalreporter.write_line(
        f"pagefleet serve processes started: {_counts['serve']}; "
        f"engines built in the test process: {_counts['engines']}"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = session.config.getoption("--durations-table")
    if target:
        selection = " ".join(str(arg) for arg in session.config.args)
        ignored = session.config.getoption("ignore") or []
        if ignored:
            selection += " --ignore=" + " --ignore=".join(str(path) for path in ignored)
        Path(target).write_text(durations_table(exitstatus, selection))


def durations_table(exitstatus: int, selection: str) -> str:
    """One pytest run's section of docs/test-durations.md (`make durations` puts the runs
    of `make test` together under the page's introduction)."""
    files = sorted(_file_seconds.items(), key=lambda item: item[1], reverse=True)
    total = sum(_file_seconds.values())
    lines = [
        f"## `{selection}`",
        "",
        f"- wall clock: {time.monotonic() - _started:.0f} s; sum of the files: {total:.0f} s;"
        f" tests: {sum(_file_tests.values())}; pytest exit status: {exitstatus}",
        f"- `pagefleet serve` processes started: {_counts['serve']}; engines built in the"
        f" test process: {_counts['engines']}",
        "",
        "| file | tests | seconds | share | servers | engines |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for path, seconds in files:
        share = seconds / total if total else 0.0
        started = _file_counts[path]
        lines.append(
            f"| `{path}` | {_file_tests[path]} | {seconds:.1f} | {share:.1%}"
            f" | {started['serve']} | {started['engines']} |"
        )
    return "\n".join(lines) + "\n"
