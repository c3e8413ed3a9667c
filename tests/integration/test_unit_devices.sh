#!/bin/sh
# The shipped unit's DevicePolicy=closed lets the GPU through on every driver generation: a
# "char-NAME" DeviceAllow= matches a name of /proc/devices (fnmatch), and NVIDIA drivers from
# 550.40 on list major 195 as "nvidia" and "nvidiactl" where older ones wrote "nvidia-frontend"
# (the unit named only the old one, so a new driver's /dev/nvidia0 was denied and the service
# fell back to the CPU). Each group name either generation writes must match one pattern.
unit="$(dirname "$0")/../../systemd/snapkvd.service.in"
[ -r "$unit" ] || { echo "FAIL: no $unit"; exit 1; }
patterns=$(sed -n 's/^DeviceAllow=char-\([^ ]*\) .*/\1/p' "$unit")
status=0
for name in nvidia-frontend nvidia nvidiactl nvidia-uvm nvidia-caps; do
    found=
    for p in $patterns; do
        # shellcheck disable=SC2254 # the pattern is a glob on purpose
        case "$name" in $p) found=$p ;; esac
    done
    if [ -z "$found" ]; then
        echo "FAIL: /proc/devices group '$name' matches no DeviceAllow=char-... of $unit"
        status=1
    else
        echo "ok: $name matches char-$found"
    fi
done
grep -q '^DevicePolicy=closed' "$unit" || { echo "FAIL: DevicePolicy=closed is gone"; status=1; }
exit $status
