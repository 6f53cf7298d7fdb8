"""The `troupe` command (`pip install` puts it on PATH): the same command line as the Rust
binary's, run inside this package's extension module."""

import sys

from . import _troupe


def main() -> None:
    sys.exit(_troupe.cli_main(["troupe", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
