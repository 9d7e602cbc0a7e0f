"""``python -m fsdp2lite ...``: the same as the ``fsdp2lite`` console script."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":  # the demo's spawned ranks import this module again; they must not rerun main
    raise SystemExit(main())
