"""What the tests share, imported as ``support.<module>`` (pytest puts tests/ on the path;
tests/support/launch.py puts it on the path of the jobs it starts).

- launch: run real multi-process Horovod jobs (horovodrun, mpirun, one process) and read
  what each rank reported; whether a process is alive
- elastic_jobs: elastic ``horovodrun`` jobs with a discovery script that changes over time
- hvdrun_fast_discovery: ``horovodrun`` polling its discovery every 0.5 s (run by path)
- training_logs: read the workers' training logs and check every sample once, replicas alike
- soak: the seeded elastic soaks (also a script: ``python tests/support/soak.py --help``)
- bed: a cluster of network namespaces with an sshd each; faults: elastic jobs on it with a
  host's failure injected; pool: several jobs sharing its hosts; lifetime: a worker wrapper
  logging when it started and ended (run by path)
- second_user: acting as a second local user; full_disk: filling a small file system
- hooked_optimizer: an AdamW whose step can be made to fail part way; small_jobs: a small
  classifier to train; swap_pairs: the swap tests' state-on-disk-beside-in-memory pairs
- gloo_store: a key-value store like horovodrun's; silent_host: a listener that says nothing
- readme: the README's minimal loop and elastic command; discovery: hvd-adapt-discover run
  in this process on a host file

Fixtures are in the conftest.py files (tests/, tests/swap/, tests/cluster/).
"""
