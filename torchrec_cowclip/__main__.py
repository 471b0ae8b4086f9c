"""``python -m torchrec_cowclip train ...``: see :mod:`torchrec_cowclip.train.cli`."""

import sys

from torchrec_cowclip.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
