#!/usr/bin/env bash
# The agent pod of deploy/kubernetes/agent-pod.yaml with a real container
# runtime: builds both images from deploy/Dockerfile, then runs the pod's
# containers as the manifest describes (test/pode2e: fenceline-bin, the
# native sidecar with the pod's own bus identity, checkout through the git
# fence, the agent wrapped in "fenceline agent"; hardened: uid 65532,
# --cap-drop ALL, no-new-privileges, read-only root) beside a lease bus, a
# git server and a Postgres on this machine, and prints one line per check:
#
#   PASS ready                        sidecar ready (lease ... held) 0.41 s after ...
#   PASS in-scope-write ...
#
#   scripts/pod-e2e.sh [-v]
#
# Runtime: podman (Debian's 4.3 works: apt-get install podman runc), run as
# root. With no image registry reachable the base images are made with
# mmdebstrap from Debian's archive (apt-get install mmdebstrap) and cached
# in $FENCELINE_POD_E2E_CACHE (default ~/.cache/fenceline-pod-e2e); a
# second run reuses them. The Go module and build caches of this machine
# are mounted into the build, so the image's binary is built as fast as a
# local one. See deploy/README.md ("Running it locally").
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
verbose=()
[ "${1:-}" = "-v" ] && verbose=(-v)

if ! command -v podman >/dev/null; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    echo "pod-e2e: docker builds the images but the pod runs on podman (a pod's shared network namespace with a path to this machine's loopback: slirp4netns); install podman" >&2
  else
    echo "pod-e2e: no container runtime: apt-get install podman runc (deploy/README.md, \"Running it locally\")" >&2
  fi
  exit 1
fi
rt=podman
cache=${FENCELINE_POD_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fenceline-pod-e2e}
mkdir -p "$cache"

# Runtime set-up: runc refuses a container whose default rlimits exceed
# this machine's hard limits (podman's default nofile is 1048576); give it
# limits that fit, unless the machine's containers.conf already does.
if ! grep -qs '^ *default_ulimits' /etc/containers/containers.conf && [ -z "${CONTAINERS_CONF:-}" ]; then
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  [ "$nofile" = unlimited ] && nofile=1048576
  [ "$nproc" = unlimited ] || [ "$nproc" -gt 4096 ] && nproc=4096
  [ "$nofile" -gt 20000 ] && nofile=20000
  printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' "$nofile" "$nofile" "$nproc" "$nproc" >"$cache/containers.conf"
  export CONTAINERS_CONF="$cache/containers.conf"
fi
echo "== $($rt --version), $(runc --version 2>/dev/null | head -1), kernel $(uname -r)"

# Base images: the registry's when it answers, else made here.
goroot=$(go env GOROOT); gover=$(go env GOVERSION)
build_args=()
if [ "${FENCELINE_POD_E2E_BASE:-}" != mmdebstrap ] && timeout 60 $rt pull -q docker.io/library/debian:bookworm-slim >/dev/null 2>&1; then
  echo "== base images from the registry (this branch is not run on the build machine, which reaches none)"
  base=debian:bookworm-slim
else
  echo "== base images from Debian's archive (mmdebstrap; cached in $cache)"
  command -v mmdebstrap >/dev/null || { echo "pod-e2e: no registry and no mmdebstrap: apt-get install mmdebstrap" >&2; exit 1; }
  mirror=${FENCELINE_POD_E2E_MIRROR:-http://deb.debian.org/debian}
  # force-unsafe-io: a throwaway chroot needs no fsync per file (here
  # 3.5 min instead of about 10 for the minbase one).
  mm=(mmdebstrap --quiet --format=tar --variant=minbase --dpkgopt=force-unsafe-io --dpkgopt='path-exclude=/usr/share/{doc,man,locale,info}/*')
  pids=()
  # debian:bookworm-slim's stand-in.
  [ -f "$cache/slim.tar" ] || { "${mm[@]}" bookworm "$cache/slim.tar.part" "$mirror" && mv "$cache/slim.tar.part" "$cache/slim.tar"; } &
  pids+=($!)
  # golang:1.26-bookworm's: gcc and libc headers (pg_query's cgo), git,
  # and this machine's Go toolchain; also the agent's image (bash, git,
  # psql).
  [ -f "$cache/tools-$gover.tar" ] || { "${mm[@]}" --include=ca-certificates,git,gcc,libc6-dev,postgresql-client-15 \
    --customize-hook="copy-in $goroot /usr/local" bookworm "$cache/tools-$gover.tar.part" "$mirror" &&
    mv "$cache/tools-$gover.tar.part" "$cache/tools-$gover.tar"; } &
  pids+=($!)
  for p in "${pids[@]}"; do wait "$p"; done
  # distroless/static's: users, CA certificates, /tmp.
  if [ ! -f "$cache/static.tar" ]; then
    s=$(mktemp -d)
    mkdir -p "$s/etc/ssl/certs" "$s/tmp" && chmod 1777 "$s/tmp"
    printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$s/etc/passwd"
    printf 'root:x:0:\nnonroot:x:65532:\n' >"$s/etc/group"
    cp /etc/ssl/certs/ca-certificates.crt "$s/etc/ssl/certs/"
    tar -C "$s" -cf "$cache/static.tar" . && rm -rf "$s"
  fi
  imp() { # tar image [--change ...]
    local tar=$1 img=$2; shift 2
    $rt image exists "$img" && [ "$($rt image inspect -f '{{index .Labels "fenceline.e2e.tar"}}' "$img" 2>/dev/null)" = "$(stat -c %Y "$tar")" ] && return
    $rt import -q "$@" --change "LABEL fenceline.e2e.tar=$(stat -c %Y "$tar")" "$tar" "$img" >/dev/null
  }
  imp "$cache/slim.tar" localhost/fenceline-e2e-base:slim --change 'CMD ["bash"]'
  imp "$cache/tools-$gover.tar" "localhost/fenceline-e2e-base:go-$gover" \
    --change 'ENV PATH=/usr/local/go/bin:/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'ENV GOPATH=/go'
  imp "$cache/static.tar" localhost/fenceline-e2e-base:static --change 'USER 65532:65532'
  build_args=(--build-arg "GO_IMAGE=localhost/fenceline-e2e-base:go-$gover"
    --build-arg DEBIAN_IMAGE=localhost/fenceline-e2e-base:slim
    --build-arg STATIC_IMAGE=localhost/fenceline-e2e-base:static)
  base=localhost/fenceline-e2e-base:go-$gover
fi
echo "== base images ready at $((SECONDS - t0)) s"

# The images, from deploy/Dockerfile as it is. This machine's module and
# build caches are mounted into the build stage (podman build -v).
mkdir -p "$(go env GOMODCACHE)" "$(go env GOCACHE)"
# The build stage's `go mod download` fetches every module go.sum names,
# not only those a build here needed: fetch them here first, through this
# machine's proxy and certificates (the build container has neither), so
# the stage finds them all in the mounted cache.
go mod download
vols=(-v "$(go env GOMODCACHE):/go/pkg/mod" -v "$(go env GOCACHE):/root/.cache/go-build")
b0=$SECONDS
$rt build -q "${build_args[@]}" "${vols[@]}" -f deploy/Dockerfile --target sidecar -t localhost/fenceline-sidecar:e2e . >/dev/null
$rt build -q "${build_args[@]}" "${vols[@]}" -f deploy/Dockerfile --target static -t localhost/fenceline:e2e . >/dev/null
size() { $rt image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1/1e6}'; }
echo "== images built in $((SECONDS - b0)) s: fenceline-sidecar $(size localhost/fenceline-sidecar:e2e), fenceline (static) $(size localhost/fenceline:e2e)"
# The sidecar image's user: fenceline, uid and gid 65532 (not an unnamed
# group), owning its state directory.
who=$($rt run --rm --entrypoint sh localhost/fenceline-sidecar:e2e -c 'id; stat -c %U:%G /var/lib/fenceline' | tr '\n' ' ')
image_status=0
case "$who" in
  "uid=65532(fenceline) gid=65532(fenceline) groups=65532(fenceline) fenceline:fenceline ") echo "PASS image-user                   sidecar image: $who" ;;
  *) echo "FAIL image-user                   sidecar image: $who(want uid and gid 65532, both named fenceline)"; image_status=1 ;;
esac
# The agent's own image: any image with a shell; this one has git and psql.
if [ "$base" = debian:bookworm-slim ]; then
  printf 'FROM docker.io/library/debian:bookworm-slim\nRUN apt-get update && apt-get install -y --no-install-recommends git postgresql-client ca-certificates && apt-get clean && rm -rf /var/lib/apt/lists/*\n' |
    $rt build -q -t localhost/fenceline-e2e-agent:e2e -f - "$(mktemp -d)" >/dev/null
else
  $rt tag "$base" localhost/fenceline-e2e-agent:e2e
fi

# The real Codex CLI (pinned by test/agents/package-lock.json; .ci/run
# installs it): its native binary is static, so any agent image runs it.
codex=()
if [ ! -d test/agents/node_modules/@openai ] && command -v npm >/dev/null; then
  (cd test/agents && npm ci --no-audit --no-fund >/dev/null 2>&1) || true
fi
cbin=$(find test/agents/node_modules -path '*x86_64-unknown-linux-musl/bin/codex' -type f 2>/dev/null | head -1)
if [ -n "$cbin" ]; then
  codex=(-codex "$cbin")
else
  echo "== WARNING: no Codex CLI in test/agents/node_modules (npm ci there): the codex-in-pod check is SKIPPED"
fi

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/fenceline" ./cmd/fenceline
go build -o "$bin/pode2e" ./test/pode2e
CGO_ENABLED=0 go build -o "$bin/go-resolver" ./attempt/testdata/capclient
status=0
"$bin/pode2e" -fenceline "$bin/fenceline" -sidecar-image localhost/fenceline-sidecar:e2e \
  -agent-image localhost/fenceline-e2e-agent:e2e -go-resolver "$bin/go-resolver" "${codex[@]}" "${verbose[@]}" || status=$?
[ $status = 0 ] && status=$image_status
echo "== pod-e2e $([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - t0)) s of wall time"
exit $status
