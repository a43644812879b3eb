"""What a launcher or a cluster scheduler needs from a job: beyond one machine.

- :mod:`.hints`: the speed-up curve a job publishes (a versioned JSON file),
  read and written with the standard library alone;
- :mod:`.rule`: which hosts pay, from that curve (the marginal-efficiency
  rule, hysteresis, growth bounds, existing hosts first);
- :mod:`.base`: the base discovery's answer (a host file or a command run
  within its deadline, host names checked);
- :mod:`.probe`: which new hosts answer on their sshd port, in parallel;
- :mod:`.sessions`: the elastic driver's commands to each host, ended for a
  host that stopped answering, and found for an arbiter's evidence;
- :mod:`.discover`: ``hvd-adapt-discover``, the host-discovery script that
  wraps any base discovery with the rule (or asks an arbiter), and
  :mod:`.discovery_state`, what it remembers between its runs;
- :mod:`.standby`: ``hvd-adapt-worker``, warm standby workers that boot while
  the job trains and are handed the slot Horovod launches; its two programs:
  :mod:`.standby_supervisor` (``--standby``) and :mod:`.launch_stub` (a slot);
- :mod:`.ready`: the standbys' ready files, which the discovery counts;
- :mod:`.job_supervisor`: ``hvd-adapt-run``, which launches a job again when
  Horovod's driver gives up on it while it could go on, reading how each run
  ended from horovodrun's output (:mod:`.launcher_output`);
- :mod:`.allocation`: how a pool of hosts is split among jobs by their
  curves (Pollux's objective), a pure function;
- :mod:`.arbiter`: ``hvd-adapt-arbiter``, the process that splits a pool
  among jobs; :mod:`.arbiter_files` what it and the jobs exchange in its
  folder, :mod:`.arbiter_client` a job's side of that.

Everything here imports the standard library only (no torch, numpy or
Horovod; a standby imports the library while it boots): Horovod runs the
discovery script every second, and each run must answer in milliseconds; an
arbiter is a scheduler's process that needs none of them.
"""
