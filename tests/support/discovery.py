"""hvd-adapt-discover run in this process on a host file, as Horovod's driver runs it."""
import time

from hvd_adapt.scheduling import discover as discover_module
from hvd_adapt.scheduling.hints import make_hints, write_hints


class Discovery:
    """Runs the discovery in this process on a host file, as Horovod would every second."""

    def __init__(self, tmp_path, hosts, *extra, hints=False):
        self.hostfile = tmp_path / "hosts.txt"
        self.hints = str(tmp_path / "hints.json")
        self.tmp_path = tmp_path
        self.set_hosts(hosts)
        # No hold after a resize unless a test asks for one.
        self.extra = ["--hold", "0"] + list(extra) + (["--hints", self.hints] if hints else [])

    def set_hosts(self, hosts):
        self.hostfile.write_text("".join(f"{h}\n" for h in hosts))

    def publish(self, replicas, curve, timed, written_at=None):
        hints = make_hints(replicas, 1, timed, 8, time.time(), curve)
        if written_at is not None:
            hints["written_at"] = written_at
        write_hints(self.hints, hints)

    def __call__(self, *more, now=None):
        argv = ["--hostfile", str(self.hostfile), "--ssh-port", "0",
                "--state", str(self.tmp_path / "state.json")] + self.extra + list(more)
        args = discover_module.parser().parse_args(argv)
        return discover_module.discover(args, now=now)
