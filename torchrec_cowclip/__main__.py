"""``python -m torchrec_cowclip train ...``: see :mod:`torchrec_cowclip.cli`."""

import sys

from torchrec_cowclip.cli import main

if __name__ == "__main__":
    sys.exit(main())
