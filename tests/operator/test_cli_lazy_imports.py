"""The `pagefleet` command imports a subcommand's module only when that subcommand runs:
`pagefleet operator` and `pagefleet router` start in the operator's image, which has no
torch, and `pagefleet --help` lists every subcommand without importing any of them."""

import subprocess
import sys

import pytest

# Run in a fresh interpreter: this test process has long since imported torch.
PROBE = """
import sys
from pagefleet_serve.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    assert exit.code == 0, exit.code
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy'})
print('HEAVY', ' '.join(heavy))
# The operator validates specs with the pod's own torch-free vocabulary and parsers
# (pagefleet_serve.config, pagefleet_serve.model_uri); the server, the engine and the bench
# client are the subcommands' own modules.
stack = ('pagefleet_serve.server', 'pagefleet_serve.engine', 'pagefleet_bench')
print('STACK', ' '.join(sorted(m for m in sys.modules if m.startswith(stack))))
"""


def probe(*argv: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


@pytest.mark.parametrize("argv", [["operator", "--help"], ["router", "--help"], ["--help"]])
def test_help_imports_neither_torch_nor_the_serving_stack(argv):
    out = probe(*argv)
    assert "\nHEAVY \n" in out, out
    assert out.endswith("STACK \n"), out
    if argv == ["--help"]:
        assert all(name in out for name in ("serve", "bench", "operator", "router"))


def test_serve_help_imports_the_serve_module_and_shows_its_flags():
    out = probe("serve", "--help")
    assert "--max-num-seqs" in out
    assert "pagefleet_serve.server.serve" in out.splitlines()[-1]
