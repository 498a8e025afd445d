"""Build (or find) one of the package's C++ CPU extensions with torch.utils.cpp_extension.

Each is compiled on first use (a C++ compiler is needed) and cached under
TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions by default), named by a digest of its
sources and flags, so two versions (an upgrade, two checkouts sharing the directory) sit side
by side instead of rebuilding over each other. `python -m pagefleet_kernels.cpu_attention`
builds them ahead of the first engine start.

Every extension is built with -fopenmp: ATen's `at::parallel_for` is a header template
that runs its loop on one thread unless the file that includes it is compiled with OpenMP
(torch's own libgomp is already loaded in the process, so the extension joins its thread
pool). Built without it, the attention kernel ran on one thread whatever
`torch.set_num_threads` said: a batch-64 decode call took as long with two threads as with one.

And with -fno-trapping-math, which changes no result: GCC vectorizes `std::nearbyint` (the
exp of the softmax, SiLU and GELU) only when it may ignore floating-point traps, and
otherwise leaves those loops scalar (vroundss, a lane at a time).
"""

import functools
import hashlib
import logging
from pathlib import Path

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")


@functools.cache
def load_extension(name: str, source: str, flags: tuple[str, ...] = ()):
    """The compiled module of `csrc/<source>` (with the shared headers of csrc/), or None
    when it cannot be built here (no compiler, no headers)."""
    from torch.utils import cpp_extension

    all_flags = [*BASE_FLAGS, *flags]
    digest = hashlib.sha256(" ".join(all_flags).encode())
    for path in [CSRC / source, *sorted(CSRC.glob("*.h"))]:
        digest.update(path.read_bytes())
    try:
        return cpp_extension.load(
            name=f"{name}_{digest.hexdigest()[:12]}",
            sources=[str(CSRC / source)],
            extra_cflags=all_flags,
            extra_ldflags=["-fopenmp"],
        )
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("the C++ extension %s could not be built (%s); using torch", name, exc)
        return None
