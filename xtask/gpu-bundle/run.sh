#!/usr/bin/env bash
# Runs the tests of a `cargo xtask gpu-bundle` on a machine that has a GPU,
# the PyTorch the bundle was built for, and a checkout of the same commit,
# but no Rust toolchain.
#
#   run.sh [--workspace DIR] [--out DIR] [NEXTEST-RUN-ARGS...]
#
#   --workspace DIR  the checkout the tests run in (default: the current
#                    folder); nextest remaps the build's paths onto it
#   --out DIR        where the JUnit report (junit.xml) and the machine's
#                    description (machine.txt) go (default: ./gpu-run)
#   NEXTEST-RUN-ARGS passed to `cargo-nextest nextest run` (a filter such as
#                    -E 'test(cuda)', --test-threads N, ...)
#
# The test binaries load libtorch from the PyTorch of `python3` (or
# $WASMRPC_PYTHON), which must be the version the bundle was built against.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=/dev/null
. "$here/bundle.env"

workspace=$PWD
out=$PWD/gpu-run
while [ $# -gt 0 ]; do
    case "$1" in
        --workspace) workspace=$(cd "$2" && pwd); shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done
mkdir -p "$out"

python=${WASMRPC_PYTHON:-python3}
read -r torch_dir torch_version torch_git < <("$python" -c \
    'import os, torch; print(os.path.dirname(torch.__file__), torch.__version__, torch.version.git_version)') || {
    echo "run.sh: $python cannot import torch; set WASMRPC_PYTHON to a Python with torch $BUNDLE_TORCH_VERSION" >&2
    exit 2
}
if [ "$torch_version" != "$BUNDLE_TORCH_VERSION" ]; then
    echo "run.sh: this bundle was built against torch $BUNDLE_TORCH_VERSION, but $python has torch $torch_version ($torch_dir)" >&2
    echo "run.sh: build one for it with: cargo xtask gpu-bundle --torch ${torch_version%%+*}" >&2
    exit 2
fi
if [ "$torch_git" != "$BUNDLE_TORCH_GIT" ]; then
    echo "run.sh: warning: torch $torch_version here is commit $torch_git, the bundle's is $BUNDLE_TORCH_GIT" >&2
fi
# The binaries' RUNPATH names the build machine's libtorch; this one wins.
export LD_LIBRARY_PATH="$torch_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

extract=$(mktemp -d "${TMPDIR:-/tmp}/wasmrpc-gpu-bundle.XXXXXX")
trap 'rm -rf "$extract"' EXIT
# The test binaries name the plugins' .wasm files by their build-time
# paths (wasmrpc-plugins' constants): point that folder at the archive's copy.
mkdir -p "$(dirname "$BUNDLE_PLUGINS_DIR")"
if [ -e "$BUNDLE_PLUGINS_DIR" ] && [ ! -L "$BUNDLE_PLUGINS_DIR" ]; then
    echo "run.sh: $BUNDLE_PLUGINS_DIR exists and is not a link; not replacing it" >&2
    exit 2
fi
ln -sfn "$extract/target/$BUNDLE_PLUGINS_REL" "$BUNDLE_PLUGINS_DIR"

nextest=$here/cargo-nextest
if [ ! -x "$nextest" ]; then
    xz -dc "$here/cargo-nextest.xz" > "$extract/cargo-nextest"
    chmod +x "$extract/cargo-nextest"
    nextest=$extract/cargo-nextest
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "torch: $torch_version ($torch_git) at $torch_dir"
    echo "bundle: built from commit $BUNDLE_COMMIT against torch $BUNDLE_TORCH_VERSION"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
        sed 's/^/gpu: /' || echo "gpu: none (nvidia-smi absent)"
} > "$out/machine.txt"
cat "$out/machine.txt"

status=0
"$nextest" nextest run \
    --archive-file "$here/tests.tar.zst" \
    --extract-to "$extract" \
    --workspace-remap "$workspace" \
    --profile gpu-bundle \
    "$@" || status=$?
# nextest writes the report under the remapped workspace's target folder.
cp "$workspace/target/nextest/gpu-bundle/junit.xml" "$out/junit.xml" 2>/dev/null ||
    echo "run.sh: no JUnit report was written" >&2
exit "$status"
