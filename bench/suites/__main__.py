"""`python -m bench.suites --update bench/README.md` rewrites the README's suites table from the registry;
`--check bench/README.md` exits 1 when it is stale; without options, prints the table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.suites import readme_table, replace_table, update_readme


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--update", metavar="README", help="rewrite README's suites table")
    p.add_argument("--check", metavar="README", help="exit 1 if README's suites table is stale")
    args = p.parse_args(argv)
    if args.update:
        update_readme(Path(args.update))
    elif args.check:
        text = Path(args.check).read_text()
        if replace_table(text, args.check) != text:
            sys.exit(f"{args.check}: the suites table is stale: run `python -m bench.suites --update {args.check}`")
    else:
        print(readme_table())


if __name__ == "__main__":
    main()
