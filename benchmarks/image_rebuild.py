"""Time of an image "build" whose inputs did not change (prints figures; asserts nothing).

    DOCKER_HOST=... python benchmarks/image_rebuild.py --base-image kit-base/bookworm:local \
        --ca-bundle /etc/ssl/certs/ca-certificates.crt --wheelhouse /opt/wheels --build-network host
    nox -s bench_image -- <the same options>

The first call builds the CPU image if it is missing (minutes); the second, with the same inputs,
must find it by its input hash. Baseline, measured in the same run: one engine round trip
(`docker version` through the SDK), the least any call to the engine costs. Target: <= 5 s.
"""

from __future__ import annotations

import sys
import time

from validate import build, cli, containers, request


def main() -> int:
    args = cli.build_parser().parse_args(["rehearse", "--container", *sys.argv[1:]])
    engine = containers.Engine()
    t = time.monotonic()
    engine.client.version()
    round_trip = time.monotonic() - t
    t = time.monotonic()
    tag, _, _ = build.image(engine, request.of(args).image, "cpu")
    first = time.monotonic() - t
    t = time.monotonic()
    again, _, _ = build.image(engine, request.of(args).image, "cpu")
    second = time.monotonic() - t
    assert again == tag
    print(f"image {tag}")
    print(f"  first call (built or found):        {first:8.2f} s")
    print(f"  second call, unchanged inputs:       {second:8.2f} s (target <= 5 s)")
    print(f"  baseline, one engine round trip:     {round_trip:8.3f} s; "
          f"second / baseline = {second / round_trip:.0f}x (hashing the build inputs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
