"""Print the mutation score of a finished `mutmut run` and every mutant that was not killed.

Usage: python mutation/report.py <staging dir>   (run by `make mutation`)

Mutants named in mutation/equivalent-mutants.md (one `name` per entry, in backticks) are
reported as equivalent rather than as missing tests; the score is shown both over all
mutants and over the non-equivalent ones.
"""

import re
import subprocess
import sys
from pathlib import Path

EQUIVALENT_FILE = Path(__file__).with_name("equivalent-mutants.md")
KILLED = {"killed", "timeout"}  # a mutant that hangs the tests is caught by the timeout


def mutmut(staging: Path, *args: str) -> str:
    mutmut_bin = Path(sys.executable).with_name("mutmut")
    return subprocess.run(
        [str(mutmut_bin), *args], cwd=staging, check=True, capture_output=True, text=True
    ).stdout


def statuses(staging: Path) -> dict[str, str]:
    found = {}
    for line in mutmut(staging, "results", "--all", "true").splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            found[name] = status
    return found


def changed_lines(staging: Path, name: str) -> str:
    diff = mutmut(staging, "show", name).splitlines()
    changes = [
        line[1:].strip()
        for line in diff
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    return "  =>  ".join(changes)


def main(staging: Path) -> int:
    found = statuses(staging)
    if not found:
        print("no mutation results: did `mutmut run` finish?")
        return 1
    equivalent = set(re.findall(r"`([^`\s]+__mutmut_\d+)`", EQUIVALENT_FILE.read_text()))
    killed = sum(status in KILLED for status in found.values())
    not_killed = {name: status for name, status in found.items() if status not in KILLED}
    missed = {name: status for name, status in not_killed.items() if name not in equivalent}
    stale = sorted(equivalent - set(not_killed))
    total, effective = len(found), len(found) - len(set(not_killed) & equivalent)

    print(f"mutants: {total}, killed: {killed}, not killed: {len(not_killed)}")
    print(f"score: {100 * killed / total:.1f}% of all mutants")
    print(
        f"score: {100 * killed / effective:.1f}% of the {effective} non-equivalent mutants "
        f"({len(not_killed) - len(missed)} equivalent, see {EQUIVALENT_FILE.name})"
    )
    if missed:
        print("\nnot killed and not known to be equivalent:")
        for name, status in sorted(missed.items()):
            print(f"  {name} [{status}]: {changed_lines(staging, name)}")
    if stale:
        print(f"\nlisted as equivalent but killed or gone (update {EQUIVALENT_FILE.name}):")
        for name in stale:
            print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
