#!/usr/bin/env bash
# Runs a command with its host memory capped, as on a machine with that much RAM (issue 50: 32 GB desktops):
#   bash bench/checks/mem_limit.sh <GiB> <command ...>
# A new cgroup v2 group (needs root and a writable /sys/fs/cgroup, as on the device machine) with memory.max = <GiB>
# and no swap holds the command and its children; page cache counts against the cap, as it does for a desktop's RAM.
# At the end it prints the group's memory.peak (bytes and GiB, where the kernel has it) and its memory.events
# (oom_kill > 0: the kernel killed a process at the cap), then removes the group. Exit status: the command's.
set -uo pipefail
[ $# -ge 2 ] || { sed -n '2,7p' "$0"; exit 2; }
gib=$1; shift
root=/sys/fs/cgroup
grp=$root/int8-mem-$gib-$$
if [ "$(stat -fc %T "$root" 2>/dev/null)" != cgroup2fs ]; then
  echo "[mem_limit] $root is not a cgroup v2 file system here: no memory cap can be set" >&2; exit 3
fi
if ! mkdir "$grp" 2>/dev/null; then
  echo "[mem_limit] cannot create a cgroup under $root (not root, or not writable here)" >&2; exit 3
fi
if [ ! -e "$grp/memory.max" ]; then
  rmdir "$grp"; echo "[mem_limit] the memory controller is not enabled for $root's children" >&2; exit 3
fi
echo $((gib * 1024 * 1024 * 1024)) > "$grp/memory.max" || { rmdir "$grp"; echo "[mem_limit] memory.max refused" >&2; exit 3; }
echo 0 > "$grp/memory.swap.max" 2>/dev/null || true
echo "[mem_limit] $grp: memory.max $(cat "$grp/memory.max") bytes ($gib GiB), swap $(cat "$grp/memory.swap.max" 2>/dev/null || echo n/a)"
( echo $BASHPID > "$grp/cgroup.procs" 2>/dev/null || exit 197; exec "$@" )
rc=$?
if [ $rc -eq 197 ] && [ -z "$(cat "$grp/cgroup.procs" 2>/dev/null)" ]; then
  rmdir "$grp" 2>/dev/null; echo "[mem_limit] cannot move a process into $grp (no delegation here)" >&2; exit 3
fi
peak=$(cat "$grp/memory.peak" 2>/dev/null || echo "")
[ -n "$peak" ] && echo "[mem_limit] memory.peak $peak bytes ($(awk -v b="$peak" 'BEGIN{printf "%.2f", b/2^30}') GiB)"
echo "[mem_limit] memory.events: $(tr '\n' ' ' < "$grp/memory.events")"
echo "[mem_limit] exit status $rc"
rmdir "$grp" 2>/dev/null || true
exit $rc
