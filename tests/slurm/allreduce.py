"""One rank of a 2-node gloo all-reduce under srun + torchrun: writes what it saw to OUTDIR/rank<R>.json.

Plain torch.distributed, no megatron (so no justrl_megatron.compat): it tests the cluster, not the model.
"""

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")  # from torchrun's env
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": world, "sum": x.item(), "hosts": hosts, "host": socket.gethostname(),
        "node_rank": int(os.environ["GROUP_RANK"]), "slurm_nodeid": int(os.environ["SLURM_NODEID"]),
        "master_addr": os.environ["MASTER_ADDR"],
    }))
    dist.destroy_process_group()
