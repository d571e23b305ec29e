#!/usr/bin/env bash
# Build specserve's CPU container image (deploy/docker/Dockerfile.cpu) with docker or
# podman, whichever is present and working (docker needs a running engine).
#
#   bash scripts/build_image.sh                       # specserve:cpu from python:3.11-slim
#   bash scripts/build_image.sh --tag my/specserve:1  # another tag
#
# Without a registry (air-gapped hosts, this project's CI), podman only:
#   bash scripts/build_image.sh --local-base --torch-wheels /opt/wheels \
#       --ca-bundle /etc/ssl/certs/ca-certificates.crt
#   --local-base        a Debian bookworm base made with debootstrap (root), once, as
#                       specserve-base:bookworm; used instead of python:3.11-slim
#   --base IMAGE        any other base with python3 and python3-venv
#   --torch-wheels DIR  install torch from the wheels in DIR, not the CPU wheel index
#   --ca-bundle FILE    a CA bundle the build's pip and apt should trust (a TLS proxy)
#   --engine E          docker or podman, instead of detecting
# Progress goes to stderr; the last line on stdout is the image's tag.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=specserve:cpu
base=""
local_base=0
wheels=""
ca_bundle=""
engine=""
die() { echo "build_image.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
    --base) base="${2:?--base needs an image}"; shift 2 ;;
    --local-base) local_base=1; shift ;;
    --torch-wheels) wheels="${2:?--torch-wheels needs a directory}"; shift 2 ;;
    --ca-bundle) ca_bundle="${2:?--ca-bundle needs a file}"; shift 2 ;;
    --engine) engine="${2:?--engine needs docker or podman}"; shift 2 ;;
    # the comment block under the shebang, up to the first line of code
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null; then
    engine=podman
  else
    die "neither a running docker engine nor podman found (Debian/Ubuntu: apt-get install podman runc)"
  fi
fi
case "$engine" in docker|podman) ;; *) die "--engine must be docker or podman, not $engine" ;; esac
command -v "$engine" >/dev/null || die "$engine is not installed"
[ -z "$wheels" ] || [ -d "$wheels" ] || die "--torch-wheels $wheels is not a directory"
[ -z "$ca_bundle" ] || [ -f "$ca_bundle" ] || die "--ca-bundle $ca_bundle is not a file"
if [ "$engine" = docker ] && { [ -n "$wheels" ] || [ -n "$ca_bundle" ] || [ "$local_base" = 1 ]; }; then
  die "--local-base, --torch-wheels and --ca-bundle mount host paths into the build: podman only"
fi

if [ "$local_base" = 1 ]; then
  [ -z "$base" ] || die "--base and --local-base exclude each other"
  base=specserve-base:bookworm
  if ! podman image exists "$base"; then
    command -v debootstrap >/dev/null || die "--local-base needs debootstrap (apt-get install debootstrap)"
    [ "$(id -u)" = 0 ] || die "--local-base runs debootstrap, which needs root"
    root="$(mktemp -d)"
    trap 'rm -rf "$root"' EXIT
    echo "[build_image] making $base with debootstrap (about 40 s)" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$root" http://deb.debian.org/debian >"$root.log" 2>&1 \
      || die "debootstrap failed; its log: $root.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import -q - "$base" >/dev/null
    rm -rf "$root" "$root.log"
    trap - EXIT
  fi
fi

args=(build -f deploy/docker/Dockerfile.cpu -t "$tag")
[ -z "$base" ] || args+=(--build-arg "BASE_IMAGE=$base")
if [ "$engine" = podman ]; then
  # The build's RUN steps share the host's network (no bridge needed); --pull=never
  # keeps a local base from being looked up in a registry.
  args+=(--network host)
  [ "$local_base" = 0 ] || args+=(--pull=never)
fi
if [ -n "$wheels" ]; then
  args+=(-v "$(realpath "$wheels"):/wheels:ro" --build-arg "TORCH_PIP_ARGS=--find-links /wheels")
fi
if [ -n "$ca_bundle" ]; then
  args+=(-v "$(realpath "$ca_bundle"):/etc/ssl/certs/ca-certificates.crt:ro"
         --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi
echo "[build_image] $engine ${args[*]} ." >&2
start=$SECONDS
"$engine" "${args[@]}" . >&2
size="$("$engine" image inspect --format '{{.Size}}' "$tag")"
echo "[build_image] built $tag in $((SECONDS - start)) s, $((size / 1000000)) MB" >&2
echo "$tag"
