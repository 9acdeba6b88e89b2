#!/bin/sh
# nvidia-game-probe.sh -- a yieldproxy command probe (watchers.command).
#
# Asks nvidia-smi which processes hold a compute context on an NVIDIA GPU and
# answers in the shape yieldproxy expects from a probe:
#   exit 0  one of the NAMEs is using the GPU (prints which): yielded
#   exit 1  none of them is: not yielded
#   exit 2  usage error, or nvidia-smi is not installed: an error (state kept)
#   exit 3  nvidia-smi ran but failed (no driver, no device): an error (state kept)
#
# usage: nvidia-game-probe.sh NAME [NAME...]
#        YIELDPROXY_GPU_PROCESSES="NAME NAME" nvidia-game-probe.sh
#
# A NAME is compared, case-insensitively, with the base name of each process
# nvidia-smi lists (a Linux path or a Windows path under Wine/Proton); shell
# patterns work ('*.exe', 'blender*'): quote them.
#
# In yieldproxy.toml:
#   [watchers]
#   command = "/opt/yieldproxy/src/etc/probes/nvidia-game-probe.sh 'eldenring.exe' blender"
#
# Note: --query-compute-apps lists compute (CUDA, OpenCL, Vulkan compute)
# contexts. A game that only draws (a graphics context) may not be listed;
# for those, a process check such as `pgrep -x -i game.exe` is the probe.

set -u

if [ "$#" -eq 0 ] && [ -n "${YIELDPROXY_GPU_PROCESSES:-}" ]; then
    set -f
    # shellcheck disable=SC2086  # split the list into words, without globbing
    set -- $YIELDPROXY_GPU_PROCESSES
    set +f
fi
if [ "$#" -eq 0 ]; then
    echo "usage: $0 NAME [NAME...]  (the process names that mean the GPU is taken)" >&2
    exit 2
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi not found on PATH ($PATH): install the NVIDIA driver utilities, or use another probe" >&2
    exit 2
fi

apps=$(nvidia-smi --query-compute-apps=process_name --format=csv,noheader 2>&1)
status=$?
if [ "$status" -ne 0 ]; then
    echo "nvidia-smi failed (exit $status): $apps" >&2
    exit 3
fi

lower() {
    printf '%s' "$1" | tr '[:upper:]' '[:lower:]'
}

printf '%s\n' "$apps" | {
    while IFS= read -r path; do
        [ -n "$path" ] || continue
        base=${path##*/}
        base=${base##*\\}
        base_l=$(lower "$base")
        for name in "$@"; do
            name_l=$(lower "$name")
            # shellcheck disable=SC2254  # the NAME is a pattern on purpose
            case $base_l in
                $name_l)
                    echo "$base is using the GPU"
                    exit 0
                    ;;
            esac
        done
    done
    exit 1
}
