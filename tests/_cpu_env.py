"""The environment of a subprocess that a test means to run on CPU (gloo), on any machine.

Programs that pick their device from the machine pick CUDA wherever a GPU is visible, and under
torchrun bind each rank to ``cuda:LOCAL_RANK``: examples/train.py's default device, transformers'
``from_pretrained(distributed_config=...)``, torch's ``fully_shard`` without a mesh (which Accelerate
calls). Two ranks on a one-GPU machine then ask for ``cuda:1`` ("CUDA error: invalid device ordinal"),
or share one GPU over NCCL. So every test that launches such a program on CPU starts it with
``cpu_env()``: no GPU visible (``CUDA_VISIBLE_DEVICES=""``), one thread per process, and no launcher
variables inherited from whatever started pytest.

Ranks started by ``_dist.spawn`` keep the machine's GPUs visible on purpose: they run fsdp2lite (and
torch's ``fully_shard`` on an explicit CPU mesh) on gloo, and part of what they check is that a gloo job
is a CPU job where CUDA is present too ([Note: device rule] in fsdp2lite/mesh.py).
"""

from __future__ import annotations

import os

# What torchrun (or a test's own rendezvous) sets for its ranks; a subprocess must not inherit them.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cpu_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a CPU-only subprocess (see the module docstring), with ``extra`` on top."""
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return {**inherited, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **extra}
