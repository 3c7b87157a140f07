#!/usr/bin/env bash
# Install the Slurm daemons and clients (Debian's Slurm 22.05) plus munge, for tools/local_slurm.sh and tests/test_slurm.py.
# Idempotent: returns at once when everything is already installed. Nothing is started or enabled (no systemd here);
# tools/local_slurm.sh runs the daemons in the foreground with all state in a temp dir. Needs root (apt-get).
set -euo pipefail
need=(slurmctld slurmd sbatch munged)
missing=0
for cmd in "${need[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || [[ -x "/usr/sbin/$cmd" ]] || missing=1
done
if [[ $missing == 0 ]]; then
  exit 0
fi
if [[ $(id -u) != 0 ]]; then
  echo "install_slurm: need root to apt-get install slurmctld slurmd slurm-client munge" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# A stale package list cannot find the packages; refresh it once if the first attempt fails. Two test workers may
# install at once (tests/test_slurm.py, run without `make test` first): apt waits for the other one's dpkg lock.
apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
  || { apt-get -o DPkg::Lock::Timeout=600 update -qq && apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
echo "install_slurm: installed $(dpkg-query -W -f '${Package} ${Version}  ' slurmctld slurmd slurm-client munge)"
