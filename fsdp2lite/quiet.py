"""What a job prints: other packages' noise left out, and a refusal said once.

    from fsdp2lite.quiet import quiet_known_noise, refuse
    quiet_known_noise()                       # first thing: before torchao, peft or bitsandbytes are imported
    ...
    return refuse(str(exc), rank)             # every rank; the exit code (2)

[Note: quiet commands]
A command prints its own output and nothing else. Packages it imports lazily speak up when imported or used,
once per process, so once per rank of a job: torchao's CPU build logs "Failed to load ..._C_mxfp8...so" for each
CUDA kernel library it lacks (the ``torchao`` logger), torch's pytree logs "... is an Enum subclass ..." when
torchao registers its enums, bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community",
transformers warns "`is_gradient_checkpointing` is deprecated" each time peft asks for it. Nothing in those
packages is changed; two filters keep them out:

- ``quiet_known_noise()``, for programs that run other people's code (``examples/train.py``, ``python -m
  fsdp2lite.run``): exactly the lines of ``KNOWN_NOISE`` and ``KNOWN_WARNINGS``, matched by logger (or warning
  category and module) and message. A filter on a logger object works whenever the package is imported later,
  and sees only records made on that logger: the user's own warnings and log lines, and every error, still show.
- ``quiet_other_packages()``, for fsdp2lite's own commands (``fsdp2lite ...``), whose output is all theirs: log
  records at WARNING and below dropped (fsdp2lite itself logs nothing; errors still show) and warnings raised
  outside fsdp2lite ignored, both restored afterwards. The demo's ranks are processes of their own and keep the
  defaults.

[Note: a refusal said once]
Bad input is found the same way on every rank (``examples/train.py``'s ``on_every_rank`` shares any rank's
failure with all of them), so every rank exits 2 together; only one may speak. Without torchrun rank 0 prints
the message on stderr. Under torchrun (``TORCHELASTIC_ERROR_FILE`` set) whatever a rank prints is followed by
torchrun's own failure summary, which shows each failed rank's error file (or "To enable traceback see ..." for a
rank without one): rank 0 writes the message to its error file and prints nothing, so the summary's "Root Cause"
is where it appears, once; every other rank writes one line pointing at rank 0, stamped a second later so that
torchrun picks rank 0's as the first failure. torchrun's own traceback of ``ChildFailedError`` cannot be left out
from a worker.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REFUSED = 2  # the exit code of a refusal (bad input), on every rank
STOPPED_WITH_RANK0 = "stopped with rank 0, which says why (the root cause in torchrun's summary on rank 0's node)"

# (logger, the start of what it says): other packages' import-time lines, dropped by quiet_known_noise()
KNOWN_NOISE = (
    ("torchao", r"Failed to load .*\.so"),  # its CPU build lacks the CUDA kernel libraries
    ("torch.utils._pytree", r".* is an Enum subclass and is now natively supported"),  # torchao's enums
    ("bitsandbytes.backends.cpu.ops", r"Failed to load CPU gemm_4bit_forward from kernels-community"),
)
# (category, the module raising it, the start of its message): warnings dropped by quiet_known_noise()
KNOWN_WARNINGS = (
    (FutureWarning, r"transformers\.", r"`is_gradient_checkpointing` is deprecated"),  # asked by peft
)


class _DropKnown(logging.Filter):
    """Drops a logger's records whose message starts with ``pattern``; lets every other record through."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not self.pattern.match(record.getMessage())


def quiet_known_noise() -> None:
    """Leave the lines of ``KNOWN_NOISE`` and ``KNOWN_WARNINGS`` out of this process's output, from now on
    ([Note: quiet commands]); call it before the packages are imported or used. Idempotent."""
    for name, pattern in KNOWN_NOISE:
        logger = logging.getLogger(name)  # the same object the package gets when it is imported later
        if not any(isinstance(f, _DropKnown) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropKnown(pattern))
    for category, module, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


@contextmanager
def quiet_other_packages() -> Iterator[None]:
    """Other packages' warnings and log lines at WARNING and below stay out of a command's output
    ([Note: quiet commands]); the logging and warnings settings in force before are restored."""
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)  # every logger, below ERROR: fsdp2lite has none of its own
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"(?!fsdp2lite(\.|$))")  # raised outside fsdp2lite
            yield
    finally:
        logging.disable(disabled)


def refuse(message: str, rank: int) -> int:
    """Say a refusal once for the whole job ([Note: a refusal said once]); call it on every rank. Returns the
    exit code, ``REFUSED``."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file is None:
        if rank == 0:
            print(message, file=sys.stderr, flush=True)
        return REFUSED
    stamp = int(time.time())
    if rank != 0:  # stamped after rank 0's: torchrun names the earliest failure the root cause
        message, stamp = STOPPED_WITH_RANK0, stamp + 1
    info = {"py_callstack": message, "timestamp": str(stamp)}  # as torchrun's own @record writes it
    Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return REFUSED
