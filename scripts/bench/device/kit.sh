#!/bin/bash
# Build .device-kit/ for a GPU machine of the device tool (docs/benchmarks.md "On the 16-core
# GPU machine"): ../shared/device/prepare.sh with every wheel quiverfs needs that the
# machine's image lacks or has at another version, plus run.sh of this folder.
# From the project's root:  bash scripts/bench/device/kit.sh
# Then one `run` of the device tool: command `bash .device-kit/quiverfs_run.sh`, carry
# [".device-kit"], timeout_s 450 (P8 on the root filesystem and on a fresh ext4, and
# mount_cold.py at 16 readers: ~6 minutes on 16 cores).
set -eu
cd "$(dirname "$0")/../../.."
SHARED=${SHARED:-../shared/device}
# The image has typer, rich and click at older versions, and no pydantic (typer 0.29 needs
# it), obstore or prometheus-client 0.26: without these the digest build and mountd exit 70.
EXTRA_WHEELS="obstore==0.12.1 prometheus-client==0.26.0 typer==0.29.2 rich==15.0.0 click==8.5.1
  pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  typing-extensions==4.16.0 annotated-doc==0.0.7 markdown-it-py==4.3.0 mdurl==0.1.2
  shellingham==1.5.4 pygments==2.21.0 pluggy==1.7.0 python-dateutil==4.0.0 tabulate==0.10.0
  tzdata==2026.6" bash "$SHARED/prepare.sh"
cp scripts/bench/device/run.sh .device-kit/quiverfs_run.sh
du -sh .device-kit
