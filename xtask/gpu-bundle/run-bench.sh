#!/usr/bin/env bash
# Runs the bench of `cargo xtask gpu-bundle --bench` on a machine with the
# PyTorch it was built against, in a checkout of the same commit at the path
# it was built in (the bench finds its torch script and writes target/bench/
# there):
#
#   run-bench.sh [wasmrpc-bench flags, e.g. --only cuda --json FILE]
#
# The bench and its worker processes load libtorch from the PyTorch of
# `python3` (or $WASMRPC_PYTHON), which also runs the torch side.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${WASMRPC_PYTHON:-$(command -v python3)}
torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))') || {
    echo "run-bench.sh: $python cannot import torch; set WASMRPC_PYTHON" >&2
    exit 2
}
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/wasmrpc-bench" --python "$python" "$@"
