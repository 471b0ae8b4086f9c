"""Test-session defaults.

The fused update is compiled by TorchInductor by default (torchrec_cowclip.embedding.row_step);
a cold compile costs seconds per graph, and the suite builds hundreds of small modules
in many processes. So tests run the eager update unless they ask for the compiled one
(``set_compiled_update("1")`` in-process, or ``TORCHREC_COWCLIP_COMPILE=1`` in the
environment of spawned ranks): test_row_step, the collection's reference comparisons and
one sharded case compare the compiled path with the reference; everything else checks
behaviour that is the same on both paths. An explicit value in the environment wins.
"""

import os

os.environ.setdefault("TORCHREC_COWCLIP_COMPILE", "0")
