# Sourced by the detached device scripts (gpu_fp8.sh, gpu_sensitivity.sh) after they set $dir:
# each device call lays the working tree anew, so they run from a copy of it: a poll cannot change
# the code under a run that is going on.
mkdir -p "$dir"
rm -rf /root/kit-snapshot && mkdir -p /root/kit-snapshot
tar --exclude=./.whl --exclude=./.git --exclude=./runs -cf - . | tar -xf - -C /root/kit-snapshot
cd /root/kit-snapshot || exit 1
