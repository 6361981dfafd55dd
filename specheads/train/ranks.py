"""The processes of one `specheads prepare` under `torchrun` or `accelerate launch`: who this rank is, the barriers
and small object exchanges between ranks, the check that every rank sees the same output folder, and the part
files through which ranks hand their results to rank 0.

`ranks_from_env()` reads WORLD_SIZE / RANK / LOCAL_RANK / LOCAL_WORLD_SIZE (set by both launchers) and joins the
default process group (gloo: its collectives carry a few Python objects, never tensors of the target; an existing
group, e.g. accelerate's, is reused). One process (no WORLD_SIZE, or 1) is `Ranks()`: barriers do nothing.
Work is split round-robin by index: rank r takes items k with k % world == r (`mine`).
Every rank writes only its own files; rank 0 alone writes the manifests and merged files, after a barrier. So
ranks must share one filesystem: `check_shared_folder` fails every rank with one line when they do not.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specheads.utils import SpecheadsError, atomic_write_json, read_text_bounded, remove_quietly

log = logging.getLogger(__name__)

PARTS = ".parts"  # a features folder's per-shard entries written by ranks other than rank 0's merge
NONCE = ".specheads-ranks-{}"  # rank 0's file that every rank must read back (the shared-folder check)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def multi(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> list[int]:
        """Indices 0..n-1 this rank works on: k % world == rank."""
        return [k for k in range(n) if k % self.world == self.rank]

    def barrier(self) -> None:
        if self.multi:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.multi:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.multi:
            return obj
        import torch.distributed as dist

        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SpecheadsError(f"environment {name}={raw!r}: not an integer (set by torchrun / accelerate launch)") \
            from None


def ranks_from_env() -> Ranks:
    """This process's rank; with WORLD_SIZE > 1 the default process group is joined (env:// rendezvous:
    MASTER_ADDR / MASTER_PORT, set by the launcher)."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Ranks()
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise SpecheadsError(f"environment RANK={rank}: not in 0..WORLD_SIZE-1 ({world - 1})")
    import torch.distributed as dist

    if not dist.is_initialized():
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise SpecheadsError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: start several processes with "
                                 f"`torchrun` or `accelerate launch`, which set them")
        dist.init_process_group("gloo")
    return Ranks(rank, world, local, _env_int("LOCAL_WORLD_SIZE", 1))


def check_shared_folder(ranks: Ranks, folder: Path) -> None:
    """Rank 0 writes a random nonce into `folder`; every rank reads it back after a barrier. A rank that cannot is
    one SpecheadsError on every rank: the ranks' folders are different places (another node's local disk)."""
    if not ranks.multi:
        return
    folder = Path(folder)
    nonce = ranks.broadcast(secrets.token_hex(8))
    path = folder / NONCE.format(nonce)
    if ranks.main:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(nonce)
    ranks.barrier()
    try:
        seen = read_text_bounded(path).strip() == nonce
    except OSError:
        seen = False
    flags = ranks.gather(seen)
    ranks.barrier()
    if ranks.main:
        remove_quietly(path)
    blind = [r for r, ok in enumerate(flags) if not ok]
    if blind:
        raise SpecheadsError(f"rank {blind[0]} does not see {folder} (rank 0's {path.name} is not there): prepare "
                             f"across nodes needs one shared filesystem; give every node the same output_dir on a "
                             f"shared mount (NFS, Lustre, ...)")


# ----------------------------------------------------------------------------------------- part files

def write_part(folder: Path, name: str, entry: dict) -> None:
    """A rank's result for item `name` (e.g. a shard's manifest entry), atomically, for rank 0 to merge."""
    atomic_write_json(Path(folder) / PARTS / f"{name}.json", entry)


def read_parts(folder: Path, prefix: str) -> dict[str, dict]:
    """{name: entry} of the part files `prefix*` in `folder` (unreadable ones, left by a kill, are skipped: their
    item is redone)."""
    out: dict[str, dict] = {}
    for p in sorted((Path(folder) / PARTS).glob(f"{prefix}*.json")):
        try:
            out[p.name[: -len(".json")]] = json.loads(read_text_bounded(p))
        except (OSError, ValueError):
            continue
    return out


def clear_parts(folder: Path, prefix: str) -> None:
    d = Path(folder) / PARTS
    for p in d.glob(f"{prefix}*"):
        remove_quietly(p)
    if d.is_dir() and not any(d.iterdir()):
        remove_quietly(d)
