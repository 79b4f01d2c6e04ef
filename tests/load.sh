#!/usr/bin/env bash
# Run a command while two CPU-bound processes compete for the CPUs (`make test-under-load`).
# The hogs are this script's own children, killed by their pids whatever the command's outcome;
# the command's exit status is the script's.
# Usage: tests/load.sh COMMAND [ARG...]
set -u
HOGS=2
pids=()
stop_hogs() {
    if [ "${#pids[@]}" -gt 0 ]; then
        kill "${pids[@]}" 2>/dev/null
        wait "${pids[@]}" 2>/dev/null
    fi
    pids=()
}
trap stop_hogs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq "$HOGS"); do
    yes > /dev/null &
    pids+=("$!")
done
echo "load.sh: $HOGS CPU hogs running (pids ${pids[*]})" >&2
"$@"
