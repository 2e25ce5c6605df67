#!/bin/sh
# wasmrpc, system-torch flavour of the release bundle: the binary
# (libexec/wasmrpc) carries no libtorch; this launcher finds the torch of
# the machine's Python, checks that it is the release the binary was built
# against, and runs the binary with that torch's libraries.
#
# WASMRPC_PYTHON names the Python to ask (default: python3).
# `cargo xtask dist --flavour system-torch` fills in the two values below.
set -eu
built_torch='@TORCH_VERSION@'
needed_libs='@TORCH_LIBS@'

here=$(dirname "$(readlink -f "$0")")
python=${WASMRPC_PYTHON:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
    echo "wasmrpc: this bundle uses the machine's torch, but there is no $python on PATH (set WASMRPC_PYTHON to a Python with torch $built_torch, or use a bundle that ships libtorch)" >&2
    exit 127
fi
info=$("$python" -c 'import os, torch; print(torch.__version__); print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null) || {
    echo "wasmrpc: this bundle uses the machine's torch, but $python cannot import torch (pip install torch==$built_torch, set WASMRPC_PYTHON, or use a bundle that ships libtorch)" >&2
    exit 1
}
version=$(printf '%s\n' "$info" | sed -n 1p)
lib=$(printf '%s\n' "$info" | sed -n 2p)
case "$version" in
    "$built_torch" | "$built_torch"+*) ;;
    *)
        echo "wasmrpc: this bundle was built against torch $built_torch, but $python has torch $version (from $lib): install torch==$built_torch, or build against it with \`cargo xtask build --torch-from-python\`" >&2
        exit 1
        ;;
esac
for name in $needed_libs; do
    if [ ! -e "$lib/$name" ]; then
        echo "wasmrpc: this bundle needs $name from torch, and $lib has none (a CPU-only torch for a bundle built against a CUDA one? use the cpu flavour)" >&2
        exit 1
    fi
done
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$here/../libexec/wasmrpc" "$@"
