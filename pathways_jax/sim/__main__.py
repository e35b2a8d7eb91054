"""``python -m pathways_jax.sim calibrate [--quick] [--out PATH]``: measure this machine into a profile."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pathways_jax.sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure this machine's costs into a JSON profile")
    cal.add_argument("--quick", action="store_true", help="a few seconds: 1-2 devices, no Ray")
    cal.add_argument("--out", default="calibrated.json", help="where the profile goes (JSON)")
    cal.add_argument("--devices", default=None, help="device counts, comma-separated (default 1,2,4,8)")
    cal.add_argument("--noray", action="store_true", help="skip the Ray hosts")
    cal.add_argument("--name", default=None, help="the profile's name (default: the file's)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from pathways_jax.sim._calibrate import calibrate

    devices = [int(d) for d in args.devices.split(",")] if args.devices else None
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    profile = calibrate(quick=args.quick, devices=devices, ray=not args.noray, name=name)
    profile.save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
