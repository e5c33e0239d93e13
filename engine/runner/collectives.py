"""The tensor-parallel ranks joined with torch.distributed, and the few collectives the model needs.

The ranks meet at rank 0's TCPStore (torch.distributed's rendezvous). The process group (gloo on the
CPU, NCCL on CUDA) carries the model's sums and gathers and times out after `timeout_s`, so a rank
that dies or hangs mid-step ends the step with an error instead of a hang. Rank 0's messages to the
other ranks go through the store: rank 0 posts each one without waiting for anybody (a hung rank
cannot stall it there), and the others wait for the next one as long as the server sits idle.

Sums run in a fixed order (rank 0's part first, then rank 1's, ...), the same on every rank and
every run: each rank gathers the parts and adds them itself, so all ranks hold the same bits and a
run repeats bit for bit.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# seconds a collective of the model may wait for the other ranks before the step fails
DEFAULT_TIMEOUT_S = 60.0
# the other ranks wait for rank 0's next message for as long as the server is idle
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# how long the ranks have to meet at start-up (each imports torch and loads its shard first; other
# machines may start minutes apart)
STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (torch.distributed's TCP rendezvous): rank 0's host and port."""

    master_addr: str
    master_port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class TensorParallelGroup:
    """This process's place among the ranks."""

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device) -> None:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # NOTE: gloo picks the interface of the host name; on one machine, loopback always works
        if rendezvous.master_addr in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port,
                                   rendezvous.world_size, is_master=rank == 0,
                                   timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        dist.init_process_group(backend, store=self.store, rank=rank,
                                world_size=rendezvous.world_size,
                                timeout=datetime.timedelta(seconds=rendezvous.timeout_s))
        self.rank, self.world_size, self.device = rank, rendezvous.world_size, device
        # messages sent (rank 0) or received (others) so far; rank 0's still in the store
        self._num_messages = 0
        self._posted: list[str] = []

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, part: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `part`, added in rank order (the same bits on every rank)."""
        parts = [torch.empty_like(part) for _ in range(self.world_size)]
        dist.all_gather(parts, part.contiguous())
        total = parts[0]
        for other in parts[1:]:
            total += other
        return total

    def gather_columns(self, part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's `part` [rows, widths[r]] side by side, in rank order; other ranks:
        None. (Each logit is computed whole on one rank, so the gather is exact.)"""
        padded = max(widths)
        if part.shape[-1] < padded:
            part = torch.nn.functional.pad(part, (0, padded - part.shape[-1]))
        parts = ([torch.empty_like(part) for _ in range(self.world_size)] if self.is_first
                 else None)
        dist.gather(part.contiguous(), parts, dst=0)
        if not self.is_first:
            return None
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

    def send(self, message: Any) -> None:
        """Rank 0: post `message` (any picklable value) for every other rank; returns at once."""
        self._num_messages += 1
        key = f"specserve/message/{self._num_messages}"
        self.store.set(key, pickle.dumps(message))
        self._posted.append(key)

    def receive(self) -> Any:
        """Another rank: rank 0's next message, waiting as long as it takes (an error if rank 0
        is gone: its store closes)."""
        self._num_messages += 1
        key = f"specserve/message/{self._num_messages}"
        self.store.wait([key], _IDLE_TIMEOUT)
        return pickle.loads(self.store.get(key))

    def forget_received(self) -> None:
        """Rank 0, after a pass every rank took part in: every rank has read the messages posted
        before it, so the store lets them go."""
        for key in self._posted[:-1]:
            self.store.delete_key(key)
        del self._posted[:-1]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
