#!/usr/bin/env bash
# Installs Debian's Slurm (slurm-wlm: slurmctld, slurmd, the client commands) and munge,
# for the real-Slurm launcher test (tests/launch/test_slurm_real.py). Idempotent: returns at
# once when every command is already on PATH. Installs nothing as a non-root user or where
# apt-get is missing; the test then skips and says why. Never fails the caller: exit 0 always,
# because the test suite must still run (and skip that one test) on such a machine.
set -uo pipefail

need=(slurmctld slurmd sbatch srun scontrol munged mungekey)
missing=()
for cmd in "${need[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$cmd")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm.sh: ${missing[*]} missing and cannot apt-get install here (needs root and apt);" \
       "the real-Slurm test will be skipped" >&2
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# The packages' maintainer scripts try to start the daemons through systemd/init, which
# containers lack; policy-rc.d exit 101 tells invoke-rc.d not to start anything. The test
# starts its own daemons with its own config.
policy=/usr/sbin/policy-rc.d
had_policy=0
[ -e "$policy" ] && had_policy=1
if [ "$had_policy" -eq 0 ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
fi
{
  apt-get update -qq &&
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
} || echo "install_slurm.sh: apt-get install slurm-wlm munge failed; the real-Slurm test will be skipped" >&2
[ "$had_policy" -eq 0 ] && rm -f "$policy"
exit 0
