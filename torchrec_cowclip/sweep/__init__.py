"""The scaling sweep (``torchrec-cowclip sweep``): a grid of batch sizes x recipes x seeds
trained as ordinary runs, resumable, with a table, CSV/JSON and the paper's figure.

- :mod:`.grid`: the cells, their settings, and which cells are the same run;
- :mod:`.runner`: the sweep's directory, its data (converted once), its cells' processes;
- :mod:`.report`: one row per cell, the summary over seeds and the table;
- :mod:`.plots`: the figures;
- :mod:`.cli`: the command.
"""
