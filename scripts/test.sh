#!/usr/bin/env bash
# Sets up the pinned runtime (scripts/setup_runtime.sh; reused when already built) and runs the whole
# test suite against it on the CPU. Extra arguments go to pytest (e.g. `bash scripts/test.sh -k apply`).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
bash scripts/setup_runtime.sh --miniatures
rt="${INT8_RUNTIME_DIR:-$here/.runtime}"
export TRITON_INTERPRET=1          # Triton kernels run in the interpreter (no GPU here)
# bytecode is written (into .runtime's ComfyUI copies and this clone's ignored __pycache__ folders): the ~60 Python
# processes a run starts (workers, servers, ComfyUI 0.33.0 subprocesses) then compile ComfyUI's sources once
export INT8_RUNTIME_DIR="$rt"
# ComfyUI 0.33.0 (from ../shared/comfyui, set up by setup_runtime.sh): the tests that need a current
# ComfyUI run there; without it they skip, naming COMFYUI_CURRENT.
if [ -z "${COMFYUI_CURRENT:-}" ] && [ -f "$rt/ComfyUI-current/main.py" ]; then
  export COMFYUI_CURRENT="$rt/ComfyUI-current" COMFYUI_CURRENT_PYTHON="$rt/venv-current/bin/python"
fi
echo "[test] current ComfyUI: ${COMFYUI_CURRENT:-none (tests needing it skip)}"
# Parallel: one pytest-xdist worker a core (INT8_TEST_WORKERS overrides; 0 runs in this process). Tests marked
# `serial` run one at a time (a file lock, tests/conftest.py); `-p no:xdist` among the arguments runs without xdist.
workers="${INT8_TEST_WORKERS:-$(nproc)}"
par=()
case " $* " in *" -p no:xdist "*) ;; *) [ "$workers" -gt 0 ] && par=(-n "$workers" --dist loadgroup) ;; esac
# Peak disk use during the run (every file system the suite writes to: the runtime's and the temporary folder's),
# sampled every 2 s, printed at the end.
# At the end it names the tests that were running at the peak (tests/conftest.py writes their start and end times).
used_kb() { df -Pk "$rt" "${TMPDIR:-/tmp}" | awk 'NR > 1 && !seen[$1]++ {s += $3} END {print s}'; }
disk0=$(used_kb); peakf="$(mktemp)"; echo "$disk0 $(date +%s)" > "$peakf"
export INT8_TEST_TIMELINE="$(mktemp)"
( peak=$disk0; while sleep 2; do u=$(used_kb); [ "$u" -gt "$peak" ] && { peak=$u; echo "$peak $(date +%s)" > "$peakf"; }; done ) &
sampler=$!
echo "[test] set-up done in $SECONDS s; running pytest (${par[*]:-one process})"
t0=$SECONDS
rc=0
junit="$rt/last-run.xml"  # each test's time: scripts/durations.py prints docs/DEVELOPING.md's tables from it
rm -f "$junit"
"$rt/venv/bin/python" -m pytest -q -rfEs --timeout=1200 --durations=15 --junitxml "$junit" "${par[@]}" "$@" || rc=$?
kill "$sampler" 2>/dev/null || true
echo "[test] pytest finished in $((SECONDS - t0)) s (exit $rc)"
if [ -s "$junit" ]; then
  echo "[test] where the time went (scripts/durations.py $junit):"
  "$rt/venv/bin/python" scripts/durations.py "$junit" || true
fi
read -r peak peak_t < "$peakf"
echo "[test] peak disk use during the tests: $(( (peak - disk0) / 1024 )) MiB above the $((disk0 / 1048576)) GiB used at the start"
if [ "$peak" -gt "$disk0" ]; then
  echo "[test] running at the peak ($(date -u -d "@$peak_t" +%H:%M:%S) UTC):"
  awk -v t="$peak_t" '$2 == "start" {s[$3] = $1} $2 == "end" {e[$3] = $1}
    END {for (n in s) if (s[n] <= t && (!(n in e) || e[n] >= t - 2)) print "  " n}' "$INT8_TEST_TIMELINE"
fi
rm -f "$peakf" "$INT8_TEST_TIMELINE"
if [ "$rc" -eq 5 ]; then
  echo "[test] ERROR: pytest collected no tests"; exit 1
fi
exit "$rc"
