"""Hosts on one machine as network namespaces, for the tests of ``tests/test_netns.py``.

One namespace per host (``10.77.N.i/24`` on its ``eth0``, loopback up) and one for the switch:
a bridge with the other end of each host's veth pair. ``cut(host)`` takes that end down (the
cable pulled at the switch: the host's own link stays up, its packets go nowhere, nothing tells
its processes), ``mend(host)`` puts it back. Names carry this process's id, so two test runs on
one machine do not meet; everything is deleted at the end, whatever happened.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def netns_problem() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    name = f"frprobe{os.getpid() % 100000}"
    try:
        ip("netns", "add", name)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` is not permitted here (needs root): {exc.stderr.strip()}"
    ip("netns", "del", name)
    return None


class Hosts:
    """Namespaces ``a``, ``b``, ... joined by a switch; ``address(h)``, ``cut(h)``, ``mend(h)``,
    ``command(h, cmd)`` (the command run inside host h's namespace)."""

    def __init__(self, names: list[str], subnet: int = 77) -> None:
        self.tag = f"fr{os.getpid() % 10000}"
        self.names = names
        self.subnet = subnet
        self.switch = f"{self.tag}sw"
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}{host}"

    def port(self, host: str) -> str:
        return f"{self.tag}p{host}"  # the switch's end of host's cable

    def address(self, host: str) -> str:
        return f"10.{self.subnet}.0.{self.names.index(host) + 1}"

    def __enter__(self) -> Hosts:
        try:
            ip("netns", "add", self.switch)
            self.made.append(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.names:
                ns = self.ns(host)
                ip("netns", "add", ns)
                self.made.append(ns)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("link", "add", "eth0x", "netns", ns, "type", "veth", "peer", "name",
                   self.port(host), "netns", self.switch)
                ip("-n", ns, "link", "set", "eth0x", "name", "eth0")
                ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", self.switch, "link", "set", self.port(host), "master", "br0")
                ip("-n", self.switch, "link", "set", self.port(host), "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self.made):  # a namespace's veth ends go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.made.clear()

    def cut(self, host: str) -> None:
        ip("-n", self.switch, "link", "set", self.port(host), "down")

    def mend(self, host: str) -> None:
        ip("-n", self.switch, "link", "set", self.port(host), "up")

    def command(self, host: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *cmd]


def log_tail(path: Path, n: int = 3000) -> str:
    return path.read_text()[-n:] if path.exists() else "(no log)"
