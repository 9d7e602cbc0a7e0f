#!/usr/bin/env bash
# Quick start 1: set up, then train a small GPT with fsdp2lite on 2 CPU ranks (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv  # the demo needs only the newest torch
exec .venv/bin/fsdp2lite demo "$@"
