"""Mutation testing of the CRD's CEL rules (x-kubernetes-validations) against the tests that
admit objects through apiserver_validation.py's CEL evaluator.

Usage: python mutation/cel_mutants.py   (run by `make mutation`)

Each rule's text is changed by one operator at a time (a comparison swapped, `&&` for `||`,
a `!` dropped or added, an integer constant +/-1, `has(...)` made constant, a string literal
shortened, a regex anchor dropped); a change that does not parse as CEL is skipped. For each
mutant a copy of the CRD with that one rule changed is written, and the tests run against it
(PAGEFLEET_CRD_PATH, read by tests/operator/operator_samples.py); a failing test kills it.
Mutants named in mutation/equivalent-mutants.md under "## CEL rules of the CRD" (the changed
rule's full text, in backticks) are counted apart. Exits non-zero only when the harness fails
(the unchanged CRD fails the tests, or pytest cannot run them), not on survivors.
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import celpy
import yaml

REPO = Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "inferenceservices.pagefleet.dev.yaml"
EQUIVALENT_FILE = Path(__file__).with_name("equivalent-mutants.md")
EQUIVALENT_SECTION = "## CEL rules of the CRD"
# The tests that admit objects through the CRD's schema and its CEL rules. The emulator's
# tests admit through it too, but take minutes and only create objects that are valid.
TESTS = [
    "tests/operator/test_operator_crd.py",
    "tests/operator/test_operator_contracts.py",
    "tests/operator/test_operator_adapters.py",
    "tests/operator/test_operator_task.py",
    "tests/operator/test_operator_real_cluster.py",
    "tests/operator/test_operator_hardening.py",
    "tests/operator/test_operator_parallelism.py"
    "::test_the_crd_validates_parallelism_in_the_api_servers_words",
    "tests/operator/test_operator_parallelism.py::test_nodes_may_divide_tensor_or_pipeline_alone",
    "tests/operator/test_operator_adapter_restart.py"
    "::test_both_crds_declare_the_switch_defaulting_to_true",
]
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]

SWAPS = {"<=": "<", "<": "<=", ">=": ">", ">": ">=", "==": "!=", "!=": "==", "&&": "||", "||": "&&"}
OPERATOR = re.compile(r"<=|>=|==|!=|&&|\|\||<|>")
NOT = re.compile(r"!(?!=)")
INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")
HAS = re.compile(r"has\([^()]*\)")
# A boolean call a `!` can be put before: has(...) or a receiver's string test.
BOOLEAN_CALL = re.compile(
    r"has\([^()]*\)|self(?:\.\w+)*\.(?:startsWith|endsWith|contains|matches)\('[^']*'\)"
)
STRING = re.compile(r"'[^']*'|\"[^\"]*\"")


def rules(schema: dict):
    """Every x-kubernetes-validations rule of a structural schema, nested ones included."""
    yield from schema.get("x-kubernetes-validations", [])
    for sub in schema.get("properties", {}).values():
        yield from rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from rules(schema[key])


def outside_strings(pattern: re.Pattern, text: str):
    """The matches of `pattern` in the code of a rule, not inside its string literals."""
    literals = [m.span() for m in STRING.finditer(text)]
    for match in pattern.finditer(text):
        if not any(start <= match.start() < end for start, end in literals):
            yield match


def replaced(text: str, start: int, end: int, new: str) -> str:
    return text[:start] + new + text[end:]


def mutants(text: str):
    """(change, mutated text) for every operator applied at every place it applies."""
    for m in outside_strings(OPERATOR, text):
        yield f"{m[0]} -> {SWAPS[m[0]]}", replaced(text, *m.span(), SWAPS[m[0]])
    for m in outside_strings(NOT, text):
        yield f"drop ! before {text[m.end() : m.end() + 20]}", replaced(text, *m.span(), "")
    for m in outside_strings(BOOLEAN_CALL, text):
        if text[m.start() - 1 : m.start()] != "!":
            yield f"negate {m[0]}", replaced(text, *m.span(), f"!{m[0]}")
    for m in outside_strings(INTEGER, text):
        before = " ".join(text[: m.start()].split()[-2:])  # which constant, where it repeats
        for new in (int(m[0]) - 1, int(m[0]) + 1):
            yield f"{before} {m[0]} -> {new}", replaced(text, *m.span(), str(new))
    for m in outside_strings(HAS, text):
        for new in ("true", "false"):
            yield f"{m[0]} -> {new}", replaced(text, *m.span(), new)
    for m in STRING.finditer(text):
        quote, body = m[0][0], m[0][1:-1]
        edits = {}  # new body: change
        if text[: m.start()].endswith("matches("):
            edits[body.removeprefix("^")] = "regex: drop the ^ anchor"
            edits[body.removesuffix("$")] = "regex: drop the $ anchor"
        for new in (body[1:], body[:-1]):
            edits.setdefault(new, f"{m[0]} -> {quote}{new}{quote}")
        for new, change in edits.items():
            if new != body:
                yield change, replaced(text, *m.span(), f"{quote}{new}{quote}")


def parses(text: str) -> bool:
    try:
        celpy.Environment().compile(text)
    except celpy.CELParseError:
        return False
    return True


def equivalent_texts() -> set[str]:
    """The mutated rule texts that mutation/equivalent-mutants.md argues cannot die."""
    _, _, section = EQUIVALENT_FILE.read_text().partition(f"\n{EQUIVALENT_SECTION}\n")
    section = section.split("\n## ", 1)[0]
    return set(re.findall(r"^(?:- |  )`([^`]+)`[,:]", section, re.MULTILINE))


def tests_pass(crd: dict, folder: Path) -> bool:
    """Whether the tests pass against `crd`; RuntimeError when pytest could not run them."""
    path = folder / CRD_PATH.name  # the chart's copy is found by this name
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    env = {**os.environ, "PAGEFLEET_CRD_PATH": str(path)}
    done = subprocess.run([*PYTEST, *TESTS], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"pytest exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.returncode == 0


def main() -> int:
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    found = list(rules(schema))
    equivalent = equivalent_texts()
    results, skipped, seen = [], 0, set()  # results: (rule, change, mutated rule, status)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        try:
            if not tests_pass(crd, Path(folder)):
                print("harness error: the tests fail against the unchanged CRD")
                return 1
            print(f"{'rule':60}  {'mutant':44}  result", flush=True)
            for rule in found:
                original = rule["rule"]
                for change, text in mutants(original):
                    if text in seen:
                        continue  # two operators gave the same rule
                    seen.add(text)
                    if not parses(text):
                        skipped += 1
                        continue
                    rule["rule"] = text
                    killed = not tests_pass(crd, Path(folder))
                    rule["rule"] = original
                    status = (
                        "killed" if killed else "equivalent" if text in equivalent else "SURVIVED"
                    )
                    print(f"{original[:60]:60}  {change[:44]:44}  {status}", flush=True)
                    results.append((original, change, text, status))
        except RuntimeError as error:
            print(f"harness error: {error}")
            return 1
    elapsed = time.monotonic() - started

    total = len(results)
    killed = sum(r[3] == "killed" for r in results)
    survived = [r for r in results if r[3] == "SURVIVED"]
    counted_equivalent = total - killed - len(survived)
    effective = total - counted_equivalent
    print(
        f"\nCEL rules: {len(found)}, mutants: {total}, killed: {killed}, survived: "
        f"{len(survived)}, equivalent: {counted_equivalent}, skipped (do not parse): {skipped}"
    )
    if total:
        print(f"score: {100 * killed / total:.1f}% of all mutants")
    if effective:
        print(
            f"score: {100 * killed / effective:.1f}% of the {effective} non-equivalent mutants "
            f"({counted_equivalent} equivalent, see {EQUIVALENT_FILE.name})"
        )
    for _, _, text, _ in survived:
        print(f"  survived: {text}")
    stale = sorted(equivalent - {r[2] for r in results if r[3] == "equivalent"})
    if stale:
        print(f"\nlisted as equivalent but killed or gone (update {EQUIVALENT_FILE.name}):")
        for text in stale:
            print(f"  {text}")
    print(f"\n({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
