#!/usr/bin/env bash
# Build llama-cpp-python, at the version edge-spec pins, with one GPU backend of llama.cpp, into a folder of the
# cache: not the default install, which stays the CPU build the tests use. Once built, the folder is reused.
#
#   benchmarks/build_llama_backend.sh vulkan          # Vulkan (here: Mesa's software device, lavapipe)
#   benchmarks/build_llama_backend.sh cuda --sdist F  # CUDA, from an sdist brought along (no network needed)
#   benchmarks/build_llama_backend.sh vulkan --peer   # llama.cpp's own llama-server and llama-speculative, the same way
#
# It prints the folder last. Put it first on PYTHONPATH and edge-spec loads that build's llama_cpp:
#   PYTHONPATH=$(benchmarks/build_llama_backend.sh vulkan | tail -1) edge-spec check qwen2.5-coder-1.5b
# With --peer it prints the folder of the binaries (benchmarks/peer_llama_cpp.py --bin-dir).
#
# Needs: cmake and a C++ compiler; for vulkan the Vulkan loader and headers, glslc and the SPIR-V headers (Debian 12:
# libvulkan-dev glslc spirv-headers, and mesa-vulkan-drivers for a software device; headers newer than Debian 12's
# are fetched, see vulkan_headers below); for cuda, nvcc (only this machine's GPU architecture is compiled).
set -euo pipefail

backend="${1:-}"
shift || true
sdist=""
peer=""
while [ $# -gt 0 ]; do
    case "$1" in
        --sdist) sdist="$2"; shift 2 ;;
        --peer) peer=1; shift ;;
        *) echo "unknown option $1: use --sdist FILE or --peer" >&2; exit 2 ;;
    esac
done
case "$backend" in
    vulkan) flags="-DGGML_VULKAN=on"; lib="libggml-vulkan.so" ;;
    cuda) flags="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"; lib="libggml-cuda.so" ;;
    *) echo "say which backend to build: vulkan or cuda" >&2; exit 2 ;;
esac

python="${PYTHON:-python}"
release="$("$python" -c 'from importlib.metadata import version; print(version("llama-cpp-python"))')"
cache="${EDGE_SPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edge-spec}"
folder="$cache/backends/llama-cpp-python-$release-$backend"
peer_bin="$cache/peer/llama.cpp-$release/build-$backend/bin"

if [ -z "$peer" ] && [ -f "$folder/llama_cpp/lib/$lib" ]; then
    echo "$folder"
    exit 0
fi
if [ -n "$peer" ] && [ -x "$peer_bin/llama-server" ] && [ -x "$peer_bin/llama-speculative" ]; then
    echo "$peer_bin"
    exit 0
fi

if [ -z "$sdist" ]; then
    # the llama.cpp peer's sdist (benchmarks/peer_llama_cpp.py) if it was fetched, else pip fetches it
    sdist="$cache/peer/llama.cpp-$release/llama_cpp_python-$release.tar.gz"
    if [ ! -f "$sdist" ]; then
        mkdir -p "$cache/peer/llama.cpp-$release"
        "$python" -m pip download --no-deps --no-binary :all: -d "$cache/peer/llama.cpp-$release" \
            "llama-cpp-python==$release" >&2
    fi
fi
[ -f "$sdist" ] || { echo "no sdist at $sdist: pass --sdist llama_cpp_python-$release.tar.gz" >&2; exit 2; }

# llama.cpp's Vulkan backend uses VK_EXT_layer_settings (Vulkan headers 1.3.261 and newer); Debian 12 ships 1.3.239.
# Then the headers come from Debian 13's packages, unpacked into the cache (not installed), checked by sha256.
vulkan_headers() {
    local root="$cache/backends/vulkan-headers-1.4.309"
    if [ ! -f "$root/usr/include/vulkan/vulkan.hpp" ]; then
        rm -rf "$root.partial" && mkdir -p "$root.partial"
        local pool="${DEBIAN_MIRROR:-http://deb.debian.org/debian}/pool/main"
        local deb sum
        while read -r deb sum; do
            curl -fsS -m 300 -o "$root.partial/$(basename "$deb")" "$pool/$deb" >&2
            echo "$sum  $root.partial/$(basename "$deb")" | sha256sum -c --quiet - >&2
            dpkg-deb -x "$root.partial/$(basename "$deb")" "$root.partial"
        done <<'DEBS'
v/vulkan-loader/libvulkan-dev_1.4.309.0-1_amd64.deb 8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a
s/spirv-headers/spirv-headers_1.6.1+1.4.309.0-1_all.deb dc18db866d63680351c40ac6b6bece34cb52da64a7799ce1cc4f16f6bff4d064
DEBS
        rm -rf "$root" && mv "$root.partial" "$root"
    fi
    echo "-DVulkan_INCLUDE_DIR=$root/usr/include -DSPIRV-Headers_DIR=$root/usr/share/cmake/SPIRV-Headers"
}
if [ "$backend" = vulkan ] && ! grep -qs "struct LayerSettingEXT" /usr/include/vulkan/vulkan_structs.hpp; then
    flags="$flags $(vulkan_headers)"
fi
# GGML_NATIVE: this CPU's instructions for the layers left on the CPU, as the default install is built here
flags="$flags -DGGML_NATIVE=ON"
jobs="$(nproc)"

if [ -n "$peer" ]; then
    source_dir="$cache/peer/llama.cpp-$release/llama_cpp_python-$release"
    [ -f "$source_dir/vendor/llama.cpp/CMakeLists.txt" ] || tar -xzf "$sdist" -C "$cache/peer/llama.cpp-$release"
    build_dir="$(dirname "$peer_bin")"
    echo "building llama-server and llama-speculative with $backend on $jobs cores, into $build_dir" >&2
    # shellcheck disable=SC2086  # $flags is a list of cmake options
    cmake -S "$source_dir/vendor/llama.cpp" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF $flags >&2
    cmake --build "$build_dir" --config Release -j "$jobs" --target llama-server llama-speculative >&2
    echo "$peer_bin"
    exit 0
fi

echo "building llama-cpp-python $release with $backend ($flags) on $jobs cores, into $folder" >&2
partial="$folder.partial"
rm -rf "$partial"
# pip's isolated build fetches scikit-build-core; where it is installed already (an offline machine), it is used
if "$python" -c "import scikit_build_core" 2>/dev/null; then isolation="--no-build-isolation"; else isolation=""; fi
CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
    "$python" -m pip install --no-deps $isolation --no-cache-dir --target "$partial" "$sdist" >&2
[ -f "$partial/llama_cpp/lib/$lib" ] || { echo "the build finished without $lib: see pip's output above" >&2; exit 1; }
rm -rf "$folder"
mv "$partial" "$folder"
echo "$folder"
