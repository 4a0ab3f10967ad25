"""The ``mpkern`` command line: ``mpkern info`` (more subcommands arrive with their features)."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    import mpkern

    data = mpkern.info()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    print(f"mpkern {data['version']}  (torch {data['torch']}, CUDA {data['torch_cuda']})")
    print(f"device      : {data['device']}")
    print(f"capability  : {data['capability']}")
    print(f"bf16 / fp16 : {data['bf16']} / {data['fp16']}")
    if data["native_built_against_torch"]:
        print(f"native ext  : built against torch {data['native_built_against_torch']}")
    print(f"forced      : {data['forced_backend'] or '(none; MPKERN_BACKEND unset)'}")
    print("backends:")
    for name, st in data["backends"].items():
        mark = "yes" if st["available"] else "no "
        print(f"  {name:<7} {mark}  {st['reason']}")
    print("matmul / linear on each backend:")
    for name, note in data["matmul"].items():
        print(f"  {name:<7} {note}")
    return 0


def _version() -> str:
    from mpkern import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpkern", description="mpkern: fused mixed-precision training kernels")
    p.add_argument("--version", action="version", version=f"mpkern {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="device, dtype support and which backends are available (and why not)")
    pi.add_argument("--json", action="store_true",
                    help="print mpkern.info() as JSON (version, torch, device, capability, bf16/fp16, backends with "
                         "availability and reason, matmul notes)")
    pi.set_defaults(func=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
