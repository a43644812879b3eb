"""Elastic training on Horovod: :mod:`.state` (the State), :mod:`.handlers` (what carries
each value), :mod:`.participant` (the protocol hvd_adapt's objects follow),
:mod:`.commit_copies` (a commit's copies during the next forward), :mod:`.snapshot_budget`
(which commits snapshot), :mod:`.agreement` (the
vote at a commit and a sync), :mod:`.state_checkpoints` and :mod:`.checkpoint` (whole-job
checkpoints and their file), :mod:`.run` (``run``), :mod:`.epoch` (epoch loops) and
:mod:`.drain` (the SIGTERM drain)."""
