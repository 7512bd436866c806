#!/usr/bin/env bash
# Install the system tools the deploy/observability tests use (Debian/Ubuntu, root only). Run by
# scripts/setup.sh for the tests (the README's second command); `setup.sh --core` needs none of them:
#   prometheus   -> promtool + the Prometheus server (tests/deploy/test_deploy_prometheus.py, test_metrics_scrape_e2e.py)
#   slurm-wlm    -> slurmctld, slurmd, sbatch, scontrol (tests/deploy/test_deploy_slurm_e2e.py)
#   munge        -> munged, SLURM's authentication
#   systemd      -> systemd-analyze (tests/deploy/test_deploy_systemd.py); systemd need not be running
#   etcd-server  -> etcd, a real 3-member cluster on 127.0.0.1 (tests/cluster/test_kvstore.py)
#   rsync        -> the replication baseline of benchmarks/run.py (without it those rows are n/a)
#   nftables     -> nft, one-way link cuts in the partition tests (tests/support/partition.py)
#   iproute2     -> ip: network namespaces, veth links and a bridge for the partition tests
#   fuse3        -> fusermount3 + libfuse3 (tests/support/sick_fs.py: the hung/failing filesystem tests, mfusepy)
# Idempotent: a quick no-op when every tool is already on PATH. Without root or apt-get it only says
# what is missing (the tests that need a missing tool skip themselves).
set -euo pipefail

declare -A TOOL_PKG=(
  [promtool]=prometheus
  [prometheus]=prometheus
  [slurmctld]=slurm-wlm
  [slurmd]=slurm-wlm
  [sbatch]=slurm-wlm
  [munged]=munge
  [systemd-analyze]=systemd
  [etcd]=etcd-server
  [rsync]=rsync
  [fusermount3]=fuse3
  [nft]=nftables
  [ip]=iproute2
)

missing=()
for tool in "${!TOOL_PKG[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${TOOL_PKG[$tool]}")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "system deps: all present"
  exit 0
fi
# unique package names, stable order
mapfile -t pkgs < <(printf '%s\n' "${missing[@]}" | sort -u)

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system deps: missing ${pkgs[*]} (not root or no apt-get: not installing; the tests that need them skip)" >&2
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Package maintainer scripts must not try to start services (no systemd/init running in containers).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f "$policy"' EXIT

echo "system deps: installing ${pkgs[*]}"
# Refresh the package lists only when they are missing or older than a day.
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
  apt-get update -qq || true
fi
# One retry with fresh lists; a failure is reported, not fatal: the tests that need a tool skip and say so.
if apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null \
   || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null; }; then
  echo "system deps: done"
else
  echo "system deps: apt-get could not install ${pkgs[*]}; the tests that need them will skip" >&2
fi
