"""The `troupe` command (`pip install` puts it on PATH): the same command line as the Rust
binary's, run inside this package's extension module."""

import signal
import sys

from . import _troupe


def main() -> None:
    # The command runs inside the extension module, where Python never looks at its own
    # SIGINT flag: Ctrl-C ends the process as it ends the Rust binary (`serve` installs
    # its own handler, which drains).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_troupe.cli_main(["troupe", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
