"""Command-line entry point: `bigbatch train | study | gns`."""

import sys


def main(argv=None) -> int:
    print("bigbatch: no commands yet", file=sys.stderr)
    return 2
