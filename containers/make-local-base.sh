#!/usr/bin/env bash
# Make a Debian bookworm base image locally, for machines that reach no container registry (our CI):
# debootstrap from the machine's Debian mirror, then `docker import`. The result is a local, unpinned
# base (no registry digest exists for it); runs record it as such.
# Usage: DOCKER_HOST=... containers/make-local-base.sh NAME
set -euo pipefail
name=${1:?usage: make-local-base.sh NAME}
if docker image inspect "$name" >/dev/null 2>&1; then echo "$name"; exit 0; fi
command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -E "^(URIs:|deb )" | grep -m1 -oE "https?://[^ ]+/debian" || true)
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "${mirror:-http://deb.debian.org/debian}" >/dev/null
tar -C "$root" -c . | docker import - "$name" >/dev/null
echo "$name"
