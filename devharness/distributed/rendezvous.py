"""Where the ranks of one run meet (torch.distributed's store), and the address their backends listen on.

Nothing listens where it need not. When every rank runs on this machine (mp, and Ray with every rank on
the driver's node) the ranks meet in a file store in a private temporary folder, so no TCP store listens
at all, and gloo's pairs (NCCL's bootstrap, on CUDA) listen on the loopback interface. Across machines
rank 0's TCP store listens on its node's own address (never on every interface, as a `tcp://` init method
would have it), and each rank's backend on the interface that holds its node's address.

The interfaces are named to the backends through their environment variables (GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME), set in the worker process itself as it joins: NCCL reads them when it makes its
first communicator, which may come after the process group is made.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import shutil
import socket
import struct
import sys
import tempfile
from urllib.parse import urlsplit

import msgspec

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915   # Linux: an interface's IPv4 address


class Rendezvous(msgspec.Struct, frozen=True):
    """How one rank joins the world; travels to it (a spawn's arguments, a Ray call)."""

    init_method: str                 # file://<private folder>/store on one machine, tcp://<rank 0's node>:<port> across
    bind_address: str = LOOPBACK     # this rank's: its backend's sockets listen on the interface that holds it

    @property
    def local(self) -> bool:
        """Every rank on this machine: nothing of the data plane listens off loopback."""
        return self.init_method.startswith("file://")

    @property
    def store_address(self) -> tuple[str, int] | None:
        """rank 0's TCP store (host, port); None for a file store."""
        if self.local:
            return None
        url = urlsplit(self.init_method)
        return url.hostname, url.port


def local_rendezvous() -> tuple[Rendezvous, str]:
    """A rendezvous for ranks that all run on this machine, and its private folder (the caller removes it
    with remove_folder once the workers are gone). The store file is made by the first rank that opens it,
    in a folder only this user can enter."""
    folder = tempfile.mkdtemp(prefix="devharness-rendezvous-")
    return Rendezvous(init_method=f"file://{os.path.join(folder, 'store')}"), folder


def remove_folder(folder: str | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def tcp_rendezvous(host: str, port: int) -> Rendezvous:
    """Ranks across machines: rank 0's store at host:port (host: its node's address)."""
    where = f"[{host}]" if ":" in host else host
    return Rendezvous(init_method=f"tcp://{where}:{port}", bind_address=host)


def store_listener(host: str) -> socket.socket:
    """rank 0's store socket across machines, listening on `host` (its node's address) on a free port.
    Held from the moment its port is chosen until the store takes it over: no other process can take the
    port in between, and the store listens on this address only."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 `address` on this machine, or None (not found, not IPv4, not
    Linux). The loopback address always has one: the platform's loopback interface if nothing else says."""
    found = None
    if sys.platform.startswith("linux") and ":" not in address:
        import fcntl
        for _, name in socket.if_nameindex():
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:   # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                found = name
                break
    if found is None and is_loopback(address):
        found = "lo0" if sys.platform == "darwin" else "lo"
    return found


def bind_backends(rendezvous: Rendezvous) -> str | None:
    """Name the interface that gloo's pairs and NCCL's bootstrap listen on, in this process's environment.
    On one machine it is the loopback interface, whatever the environment said; across machines, the one
    holding this rank's node address, unless the user named one. Returns the interface (None: left to the
    backend, which then picks by the host name, or NCCL by its own rules)."""
    iface = interface_of(rendezvous.bind_address)
    if iface is None:
        logger.warning("no network interface holds %s here: gloo and NCCL pick their own (GLOO_SOCKET_IFNAME and "
                       "NCCL_SOCKET_IFNAME name one)", rendezvous.bind_address)
        return None
    for var, value in (("GLOO_SOCKET_IFNAME", iface), ("NCCL_SOCKET_IFNAME", "=" + iface)):   # "=": exactly
        if rendezvous.local:
            os.environ[var] = value
        else:
            os.environ.setdefault(var, value)
    return iface


def tcp_store(rendezvous: Rendezvous, rank: int, world_size: int, timeout: datetime.timedelta,
              listener: socket.socket | None):
    """This rank's handle on the TCP store across machines. Rank 0 serves it on `listener` (store_listener's),
    which it takes over; the others connect to it. (Every rank makes its store here, never some through a
    tcp:// init method: torch prefixes the keys of a store it made itself, and the ranks would not meet.)"""
    import torch.distributed as dist
    host, port = rendezvous.store_address
    if rank == 0:
        if listener is None:
            raise RuntimeError("rank 0 of a TCP rendezvous needs the socket its store serves on (store_listener)")
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=True,
                             master_listen_fd=listener.detach(), use_libuv=True)
    return dist.TCPStore(host, port, world_size, False, timeout)
