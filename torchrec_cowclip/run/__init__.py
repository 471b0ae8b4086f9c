"""What a run leaves on disk: the ``--out`` lock (:mod:`.out_dir`), checkpoints
(:mod:`.checkpoints`) and their safe loads (:mod:`.safe_load`), the resume check
(:mod:`.resume_guard`), the run log (:mod:`.log`), the stop signal (:mod:`.stop`), the
model folder's writer and reader (:mod:`.model_folder`), and full disks in one line
(:mod:`.no_space`). Nothing here imports the training loop (``torchrec_cowclip.train``)."""
