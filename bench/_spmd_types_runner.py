"""Time the workloads under spmd_types 0.3.1 (run with bench/.deps on sys.path); prints JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _workloads import WORKLOADS, median_seconds, tensors  # noqa: E402


def main() -> None:
    import spmd_types as spmd
    import spmd_types.checker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp = mesh.get_group("tp")
    result = {"version": spmd.__version__ if hasattr(spmd, "__version__") else "0.3.1"}
    for name, workload in WORKLOADS.items():
        t = tensors()
        with spmd.set_current_mesh(mesh), spmd_types.checker.typecheck():
            for value in t.values():
                spmd.assert_type(value, {tp: spmd.R})
            result[name] = median_seconds(lambda t=t, w=workload: w(t))
    dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
