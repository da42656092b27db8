"""Two network namespaces joined by a veth pair, for network-fault tests (root only).

`NetnsPair` makes namespaces `kvp<id>` (prefill side) and `kvd<id>` (decode side) with
one veth pair between them, addresses 10.199.<n>.1 and .2 inside them only, and their
loopbacks up; nothing in the root namespace changes. `close()` deletes both namespaces,
which destroys the veth pair with them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def unavailable_reason() -> str | None:
    """Why the namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` or `tc` (iproute2) is not installed"
    probe = f"kvprobe{os.getpid() % 100000}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class NetnsPair:
    prefill_ns: str
    decode_ns: str
    prefill_dev: str
    decode_dev: str
    prefill_ip: str
    decode_ip: str

    @classmethod
    def create(cls) -> NetnsPair:
        n = os.getpid() % 100000
        pair = cls(f"kvp{n}", f"kvd{n}", f"kvp{n}v", f"kvd{n}v", f"10.199.{n % 250}.1", f"10.199.{n % 250}.2")
        try:
            pair._setup()
        except BaseException:
            pair.close()
            raise
        return pair

    def _setup(self) -> None:
        run("ip", "netns", "add", self.prefill_ns)
        run("ip", "netns", "add", self.decode_ns)
        # Created inside the prefill namespace, so the root namespace never holds either end.
        self.exec(
            self.prefill_ns,
            "ip",
            "link",
            "add",
            self.prefill_dev,
            "type",
            "veth",
            "peer",
            "name",
            self.decode_dev,
            "netns",
            self.decode_ns,
        )
        for ns, dev, ip in (
            (self.prefill_ns, self.prefill_dev, self.prefill_ip),
            (self.decode_ns, self.decode_dev, self.decode_ip),
        ):
            self.exec(ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            self.exec(ns, "ip", "link", "set", dev, "up")
            self.exec(ns, "ip", "link", "set", "lo", "up")

    def exec(self, ns: str, *cmd: str) -> None:
        run("ip", "netns", "exec", ns, *cmd)

    def prefix(self, ns: str) -> list[str]:
        """Prepend to a command line to run it inside `ns`."""
        return ["ip", "netns", "exec", ns]

    def set_link(self, up: bool) -> None:
        self.exec(self.prefill_ns, "ip", "link", "set", self.prefill_dev, "up" if up else "down")

    def throttle(self, rate: str = "10mbit") -> None:
        """Both directions: tbf on each end of the veth pair."""
        for ns, dev in ((self.prefill_ns, self.prefill_dev), (self.decode_ns, self.decode_dev)):
            self.exec(
                ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"
            )

    def close(self) -> None:
        for ns in (self.prefill_ns, self.decode_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip()}")
