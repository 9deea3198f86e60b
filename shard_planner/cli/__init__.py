"""The command line: a thin layer over the API. Each command module exposes ``add_parser(subparsers)``
and ``run(args) -> int``; only this package parses arguments or prints."""
