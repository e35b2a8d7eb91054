"""Start, inspect and stop a controller service from the command line.

    ray start --head                                   # a Ray cluster that outlives this command
    python -m pathways_jax serve --hosts 4 --devices_per_host 2 --islands 2 --scheduler fair
    python -m pathways_jax stats                       # every client process: runs, device time, bytes
    python -m pathways_jax stop

Client processes join with ``pw.init(backend="ray", address=<the address
printed>, service=<name>)``. ``--address`` (default ``auto``: the cluster
``ray start`` started on this machine) and ``--name`` (default ``pathways``)
pick the cluster and the service, given before the command or after it.
``serve`` takes every option of ``pw.serve`` (``--silent_client_timeout none``,
``--replace_lost_hosts false``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys


def _seconds_or_none(text: str) -> float | None:
    """A number of seconds, or ``none`` (no limit), as ``pw.serve`` takes it (it checks the range)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds or 'none', got {text!r}") from None


def _yes_no(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pathways_jax", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--address", default="auto", help="the Ray cluster (default: the one on this machine)"
    )
    parser.add_argument("--name", default="pathways", help="the service's name (default: pathways)")
    # Also taken after the command (`serve --hosts 4 --address HEAD:6379`, `stats --name eval`),
    # where they win over the same given before it; left out there, the ones before it hold.
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--address", default=argparse.SUPPRESS, help="the Ray cluster (default: auto)")
    where.add_argument("--name", default=argparse.SUPPRESS, help="the service's name (default: pathways)")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser(
        "serve", parents=[where], help="start a controller service (a detached Ray actor)"
    )
    start.add_argument("--hosts", type=int, required=True)
    start.add_argument("--devices_per_host", type=int, default=1)
    start.add_argument("--islands", type=int, default=None)
    start.add_argument("--scheduler", choices=("fifo", "priority", "fair"), default="fifo")
    start.add_argument("--window", type=int, default=None, help="runs in flight per island")
    start.add_argument("--max_clients", type=int, default=None)
    start.add_argument("--memory_budget", type=int, default=None, help="bytes of values for all clients")
    start.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    # The rest of pw.serve's options, with its defaults (None: pw.serve's own).
    start.add_argument(
        "--backpressure_timeout", type=_seconds_or_none, default=60.0, help="seconds, or 'none'"
    )
    start.add_argument("--stalled_client_timeout", type=float, default=30.0, help="seconds")
    start.add_argument(
        "--silent_client_timeout", type=_seconds_or_none, default=30.0, help="seconds, or 'none'"
    )
    start.add_argument("--replace_lost_hosts", type=_yes_no, default=True, help="true or false")
    start.add_argument(
        "--max_in_flight", type=int, default=None, help="executables each host keeps in flight"
    )
    start.add_argument("--starvation_limit", type=int, default=None, help="under 'priority'")
    commands.add_parser("stats", parents=[where], help="print the service's stats as JSON")
    commands.add_parser(
        "stop", parents=[where], help="stop the service (its hosts and every client's values go)"
    )
    args = parser.parse_args(argv)

    if args.command == "serve" and args.address == "local":
        # pw.serve would start a Ray cluster in this process: it, and the service, end as this returns.
        print(
            "error: --address local starts a Ray cluster in this command's process, which ends with this "
            "command (and the service with it). Start a cluster that outlives it with `ray start --head`, "
            "then serve in it (--address auto, or the address `ray start` printed).",
            file=sys.stderr,
        )
        return 1

    import pathways_jax as pw
    from pathways_jax._src.runtime import serving

    try:
        if args.command == "serve":
            svc = pw.serve(
                args.name,
                hosts=args.hosts,
                devices_per_host=args.devices_per_host,
                islands=args.islands,
                address=args.address,
                scheduler=args.scheduler,
                window=serving.DEFAULT_WINDOW if args.window is None else args.window,
                max_clients=args.max_clients,
                memory_budget=args.memory_budget,
                platform=args.platform,
                backpressure_timeout=args.backpressure_timeout,
                stalled_client_timeout=args.stalled_client_timeout,
                silent_client_timeout=args.silent_client_timeout,
                replace_lost_hosts=args.replace_lost_hosts,
                **{
                    name: value
                    for name in ("max_in_flight", "starvation_limit")
                    if (value := getattr(args, name)) is not None
                },
            )
            print(f"controller service {svc.name!r} is running in the Ray cluster at {svc.address}")
            print(f"join it with: pw.init(backend='ray', address={svc.address!r}, service={svc.name!r})")
        elif args.command == "stats":
            print(json.dumps(pw.service(args.name, address=args.address).stats(), indent=2, default=str))
        else:
            pw.service(args.name, address=args.address).stop()
            print(f"controller service {args.name!r} stopped")
    except pw.errors.PathwaysError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
