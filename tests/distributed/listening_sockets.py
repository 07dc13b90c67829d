"""Which TCP sockets a process tree listens on, and at which address, read from /proc (Linux).

A socket a process holds shows in /proc/<pid>/fd as a link to `socket:[INODE]`; /proc/net/tcp and /proc/net/tcp6
list every TCP socket of the network namespace, one a line, with its local address, its state (0A: LISTEN) and its
inode. Matching the two gives the listening sockets of exactly the processes asked about, whoever else listens on
the machine.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

import psutil

LISTEN = "0A"
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


@dataclass(frozen=True)
class Listener:
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    pid: int
    command: str = field(default="", compare=False)  # the process's first words (none once it exits)

    @property
    def everywhere(self) -> bool:
        """Bound to a wildcard: 0.0.0.0, :: or ::ffff:0.0.0.0 (every interface)."""
        mapped = getattr(self.address, "ipv4_mapped", None)
        return self.address.is_unspecified or (mapped is not None and mapped.is_unspecified)

    @property
    def loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)
        return self.address.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port} (pid {self.pid}: {self.command})"


def decode_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: the bytes as the kernel holds them, written as 32-bit words in host order (little
    endian here), so each 4-byte word is reversed: 0100007F is 127.0.0.1."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_inodes(tables: tuple[Path, ...] = TABLES) -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode -> (hex address, port)."""
    found = {}
    for table in tables:
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == LISTEN:
                hex_address, hex_port = local.split(":")
                found[inode] = (hex_address, int(hex_port, 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds (none if it is gone or not ours to read)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = fd.readlink().as_posix()
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    except OSError:
        pass
    return inodes


def tree(pid: int) -> list[psutil.Process]:
    """The process and everything it started that is still running."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listeners(pids: list[int]) -> set[Listener]:
    """The listening sockets the processes `pids` and their descendants hold."""
    listening = listening_inodes()
    found = set()
    for proc in (p for pid in pids for p in tree(pid)):
        try:
            command = " ".join(proc.cmdline()[:4])
        except psutil.Error:
            continue
        for inode in socket_inodes(proc.pid) & listening.keys():
            hex_address, port = listening[inode]
            found.add(Listener(decode_address(hex_address), port, proc.pid, command))
    return found
