#!/usr/bin/env bash
# Build specserve's image: the CPU target (CPU torch + the embedded model) or the GPU target (CUDA
# torch). On a machine that reaches Docker Hub and the PyTorch index, the defaults are all it takes:
#   deploy/build_image.sh                       # specserve:cpu
#   deploy/build_image.sh --target gpu          # specserve:gpu
# Where no image registry can be reached, make the base from Debian's packages and take torch from
# a folder of wheels (README "Docker"):
#   deploy/build_image.sh --debian-base MIRROR --torch-wheels DIR --ca-bundle FILE --network host
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: deploy/build_image.sh [options]
  --target cpu|gpu        which stage to build (default cpu)
  --tag NAME              the image's name (default specserve:TARGET)
  --base IMAGE            the base image (default: the Dockerfile's, python:3.12-slim-bookworm
                          for cpu, nvidia/cuda for gpu)
  --debian-base MIRROR    make the base here instead: Debian bookworm with Python 3.11 from
                          Debian's packages (debootstrap from MIRROR, as root), imported as
                          specserve-base:bookworm-python
  --torch-wheels DIR      install torch from the wheels in DIR (served on 127.0.0.1 for the build;
                          needs --network host) instead of the PyPI/PyTorch index
  --torch-index-url URL   the index torch comes from (default: the PyTorch index of the target)
  --ca-bundle FILE        the CA bundle pip trusts while building (a proxy that inspects TLS)
  --network MODE          the build's network (host: the registries this machine reaches)
USAGE
}

target=cpu tag="" base="" debian_mirror="" torch_wheels="" torch_index="" ca_bundle="" network=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --target) target=$2; shift 2 ;;
        --tag) tag=$2; shift 2 ;;
        --base) base=$2; shift 2 ;;
        --debian-base) debian_mirror=$2; shift 2 ;;
        --torch-wheels) torch_wheels=$2; shift 2 ;;
        --torch-index-url) torch_index=$2; shift 2 ;;
        --ca-bundle) ca_bundle=$2; shift 2 ;;
        --network) network=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build_image.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
[[ $target == cpu || $target == gpu ]] || { echo "--target must be cpu or gpu" >&2; exit 2; }
[[ -z $torch_wheels || $network == host ]] || {
    echo "--torch-wheels needs --network host (the build reaches the wheels on 127.0.0.1)" >&2
    exit 2; }
tag=${tag:-specserve:$target}
cd "$(dirname "$0")/.."

cleanup_steps=()
cleanup() { for step in "${cleanup_steps[@]}"; do eval "$step"; done; }
trap cleanup EXIT

if [[ -n $debian_mirror ]]; then
    base=specserve-base:bookworm-python
    root=$(mktemp -d)
    cleanup_steps+=("rm -rf '$root'")
    echo "making $base from Debian's packages..."
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
        bookworm "$root" "$debian_mirror" >/dev/null
    tar -C "$root" -c . | docker import - "$base" >/dev/null
fi

build_args=(--target "$target" --tag "$tag")
[[ -n $network ]] && build_args+=(--network "$network")
if [[ -n $base ]]; then
    [[ $target == cpu ]] && build_args+=(--build-arg "CPU_BASE_IMAGE=$base")
    [[ $target == gpu ]] && build_args+=(--build-arg "CUDA_BASE_IMAGE=$base")
fi
if [[ -n $torch_index ]]; then
    [[ $target == cpu ]] && build_args+=(--build-arg "TORCH_CPU_INDEX_URL=$torch_index")
    [[ $target == gpu ]] && build_args+=(--build-arg "TORCH_CUDA_INDEX_URL=$torch_index")
fi
if [[ -n $ca_bundle ]]; then
    cp "$ca_bundle" deploy/build-extra/ca-certificates.crt
    cleanup_steps+=("rm -f deploy/build-extra/ca-certificates.crt")
    build_args+=(--build-arg PIP_CERT=/opt/build-extra/ca-certificates.crt)
fi
if [[ -n $torch_wheels ]]; then
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory "$torch_wheels" "$port" >/dev/null 2>&1 &
    cleanup_steps+=("kill $! 2>/dev/null || true")
    build_args+=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$port/")
fi
dockerfile=Dockerfile
# NOTE: the classic builder where BuildKit's CLI plugin is missing (Debian's docker.io). It builds
# every stage before the target (BuildKit skips those the target does not use), so it gets the
# global ARGs and the target's stage alone
if ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0
    dockerfile=$(mktemp)
    cleanup_steps+=("rm -f '$dockerfile'")
    awk -v stage="$target" '/^FROM / { in_stage = ($NF == stage); started = 1 }
                            !started || in_stage { print }' Dockerfile > "$dockerfile"
fi
start=$(date +%s)
docker build --file "$dockerfile" "${build_args[@]}" .
echo "built $tag in $(($(date +%s) - start)) s: $(docker image inspect "$tag" --format '{{.Size}}' \
    | awk '{printf "%.0f MB", $1 / 1e6}')"
