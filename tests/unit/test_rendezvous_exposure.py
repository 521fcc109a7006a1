"""What the README's trust model says about the rendezvous store, checked against torch itself.

torch's ``TCPStore`` server (what ``env://`` rendezvous, and so Lightning, starts on rank 0 at
``MASTER_ADDR:MASTER_PORT``) listens on every interface, whatever host name it is given: ``MASTER_ADDR``
only tells the other ranks where to connect. ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` choose the
interface of the collectives' own sockets, not the store's. So the README tells users to firewall
``MASTER_PORT`` rather than to "bind to a private interface"; if torch ever binds the store to
``MASTER_ADDR``, this test fails and the README must say so.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) of the sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: TCP_LISTEN
                found.add(address)
    return found


def test_the_rendezvous_store_listens_on_every_interface_whatever_master_addr_says() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    try:
        addresses = _listening_addresses(store.port)
        assert addresses, f"nothing listens on the store's port {store.port}"
        # all zeros: INADDR_ANY (IPv4) or in6addr_any (IPv6): every interface, not 127.0.0.1 (0100007F)
        assert all(set(a) == {"0"} for a in addresses), addresses
    finally:
        del store
