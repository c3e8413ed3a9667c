#!/usr/bin/env bash
# Downloads the Python wheels tests/gpu/kvpress_speed.py needs on the device host (which has
# torch, transformers 5.17 and tokenizers 0.23 but no kvpress, and reaches no registry) into
# .whl/ at the repository root (git-ignored): kvpress 0.5.5 and the transformers / tokenizers
# versions it supports (transformers < 5.3 checks tokenizers <= 0.23.0 at import). Run it where
# pip reaches PyPI; name ".whl" in the device call's carry. check.sh installs them into its build
# directory (--no-deps: the device has the rest; kvpress_speed.py stubs kvpress's imports of
# datasets, fire and cachetools, which SnapKVPress does not use).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$SRC/.whl" kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2
ls -l "$SRC/.whl"
