"""``python -m fsdp2lite.run SCRIPT [ARGS...]``: run an unchanged training script on fsdp2lite.

    torchrun --nproc-per-node 4 -m fsdp2lite.run run_clm.py --fsdp full_shard --fsdp_config cfg.json ...
    python -m fsdp2lite.run train.py ARGS...           # one process, or under any launcher
    python -m fsdp2lite.run -m my_package.train ARGS...  # a module, as ``python -m`` runs it

The launcher calls ``fl.patch()`` first, so torch's FSDP2 names (``fully_shard``, ``FSDPModule``, the
policies, ...) resolve to fsdp2lite's in every module the script imports afterwards (the HF Trainer
through Accelerate, Lightning, TRL: fsdp2lite/integrations/patch.py); where Accelerate is installed,
through ``fsdp2lite.integrations.accelerate.install()``, which also shards bitsandbytes 4-bit bases
(fsdp2lite/integrations/bitsandbytes.py). It then runs the script as
``__main__`` with its own arguments, the way ``python SCRIPT`` would: ``sys.argv`` is ``[SCRIPT,
ARGS...]`` and ``sys.path[0]`` the script's directory (the current directory for ``-m``).

Before the script runs, ``quiet_known_noise()`` leaves other packages' known import-time lines out of its
output (torchao's "Failed to load ...so", torch's "... is an Enum subclass", bitsandbytes' kernels-community
line, transformers' "`is_gradient_checkpointing` is deprecated": [Note: quiet commands] in fsdp2lite/quiet.py);
the script's own warnings and log lines still show. When the script ends well, rank 0 says on one line of
stderr how many modules fsdp2lite sharded in its process, or warns that it sharded nothing ([Note: the exit
report]).

Exit codes: the script's own (its exceptions propagate with their traceback, exactly as without the
launcher); 2 with one line on stderr when the script or module cannot be found or the launcher's
command line is wrong.

[Note: the exit report]
A script can ask for FSDP and still not get it: on CPU Accelerate drops its FSDP plugin without a word and the
HF Trainer trains with DDP, so the launcher's rebound names are never called. ``fully_shard`` counts its calls
(``api.TALLY``: cheap, inside fsdp2lite, no hook on torch); at a clean end (the script returned, or exited 0)
rank 0 prints "fsdp2lite sharded N modules in K fully_shard calls", or a warning naming the likely reason
when K is 0. A script that fails gets no report: its own error is the news.

[Note: what the launcher does not reach]
Only this process is patched. Processes the script starts with multiprocessing's ``spawn`` (DataLoader
workers, for example) import the script again without the launcher; they see torch's names, which is
harmless unless they shard a model themselves.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from .quiet import quiet_known_noise

PROG = "python -m fsdp2lite.run"
USAGE = f"usage: {PROG} [-h] [--verbose] (SCRIPT | -m MODULE) [ARGS...]"
HELP = f"""{USAGE}

Run a training script written for torch's fully_shard (or a tool that calls it: the HF Trainer with
--fsdp and fsdp_config fsdp_version 2, Accelerate, Lightning, TRL) on fsdp2lite, without editing it.
fsdp2lite.patch() rebinds torch's FSDP2 names to fsdp2lite's before the script's imports; the script
then runs as __main__ with ARGS, as `python SCRIPT ARGS` would.

  torchrun --nproc-per-node 4 -m fsdp2lite.run run_clm.py --fsdp full_shard --fsdp_config cfg.json ...

positional arguments:
  SCRIPT         the script to run (a .py file, or a directory or zip with __main__.py)
  ARGS           passed to the script unchanged, options included

options:
  -h, --help     show this help and exit
  -m MODULE      run a module as `python -m MODULE` would, instead of a script
  --verbose      print what fsdp2lite.patch() rebound (on stderr) before running

At a clean end rank 0 prints one line on stderr: how many modules fsdp2lite sharded, or a warning when the
script called fully_shard nowhere (on CPU, Accelerate and the HF Trainer fall back to DDP). Other packages'
known import-time warnings are left out; the script's own show.

Exit status: the script's own; 2 when SCRIPT or MODULE is not found or this command line is wrong.
"""
NOTHING_SHARDED = (
    "warning: the script ran without fsdp2lite sharding anything (no fully_shard call in this process), so it "
    "trained unsharded or under another wrapper. Likely: Accelerate (and the HF Trainer through it) runs FSDP on "
    "accelerators only and on CPU falls back to DDP without a word; on GPUs, check that the script asks for FSDP2 "
    '(Trainer: --fsdp full_shard --fsdp_config with {"fsdp_version": 2}; Accelerate: fsdp_version: 2) or calls '
    "fully_shard itself"
)


class UsageError(Exception):
    """The launcher's command line or its target is wrong: one line, exit 2."""


def parse(argv: list[str]) -> tuple[str, str, list[str], bool]:
    """``(kind, target, args, verbose)`` from the launcher's arguments; kind is "script" or "module"."""
    verbose = False
    rest = list(argv)
    while rest and rest[0] == "--verbose":
        verbose, rest = True, rest[1:]
    if not rest:
        raise UsageError("no script given: name the script to run (or -m MODULE)")
    first = rest[0]
    if first == "-m":
        if len(rest) < 2:
            raise UsageError("-m needs a module name: -m MODULE [ARGS...]")
        return "module", rest[1], rest[2:], verbose
    if first.startswith("-m") and len(first) > 2:  # -mpackage.module, as python accepts
        return "module", first[2:], rest[1:], verbose
    if first.startswith("-") and first != "-":
        raise UsageError(f"unknown option {first!r} before the script: launcher options are -h, -m, --verbose")
    return "script", first, rest[1:], verbose


def check_script(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"can't open file {os.path.abspath(path)!r}: no such file")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "__main__.py")):
        raise UsageError(f"{path!r} is a directory without a __main__.py to run")


def check_module(name: str) -> None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError as exc:  # a missing parent package
        raise UsageError(f"no module named {exc.name!r} (looking for {name!r})") from None
    except ValueError:  # "" or a relative name
        raise UsageError(f"{name!r} is not an absolute module name") from None
    if spec is None:
        raise UsageError(f"no module named {name!r}")


def patch_torch(verbose: bool) -> None:
    # before the script's imports: modules imported later read the rebound names
    if importlib.util.find_spec("accelerate") is not None:  # and Accelerate's preparation: 4-bit bases sharded too
        from .integrations.accelerate import install

        report = install()
    else:
        from .integrations.patch import patch

        report = patch()
    if verbose:
        print(report, file=sys.stderr)


def report_sharding() -> None:
    """Rank 0's line at the script's clean end ([Note: the exit report]); other ranks say nothing."""
    from .api import TALLY

    if rank() != 0:
        return
    if not TALLY.calls:
        print(f"{PROG}: {NOTHING_SHARDED}", file=sys.stderr, flush=True)
        return
    modules = f"{TALLY.modules} module{'s' * (TALLY.modules != 1)}"
    calls = f"{TALLY.calls} fully_shard call{'s' * (TALLY.calls != 1)}"
    print(f"{PROG}: fsdp2lite sharded {modules} in {calls} on rank 0", file=sys.stderr, flush=True)


def rank() -> int:
    """This process's rank: torchrun's RANK, else the process group's (the script may have destroyed it), else 0."""
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run_script(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    if os.path.isfile(path):  # as `python SCRIPT`; run_path puts a directory or zip on sys.path itself
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    runpy.run_path(path, run_name="__main__")


def run_module(name: str, args: list[str]) -> None:
    sys.argv = [name, *args]  # run_module(alter_sys=True) sets argv[0] to the module's file
    sys.path[0] = os.getcwd()
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP, end="")
        return 0
    try:
        kind, target, args, verbose = parse(argv)
        if kind == "script":
            check_script(target)
        else:
            check_module(target)
    except UsageError as exc:
        print(f"{PROG}: error: {exc} (see --help)", file=sys.stderr)
        return 2
    quiet_known_noise()  # before the script imports torchao, peft or bitsandbytes
    patch_torch(verbose)
    try:
        if kind == "script":
            run_script(target, args)
        else:
            run_module(target, args)
    except SystemExit as exc:
        if exc.code in (0, None):  # `sys.exit(main())` after a run that went well
            report_sharding()
        raise
    report_sharding()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
