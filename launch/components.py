"""torchx components for torchrec_cowclip.

``train`` wraps ``torchrec-cowclip train`` in torchx's ``dist.ddp`` (torchrun under the
hood), so the same component runs on one machine (``-s local_cwd``), on Kubernetes
(``-s kubernetes``) or Slurm (``-s slurm``) - only the scheduler and its config change.

Example (2 processes on this machine, CPU, gloo)::

    .venv/bin/torchx run -s local_cwd launch/components.py:train -j 1x2 -- \\
        --model deepfm --data synthetic:100000 --batch-size 4096 --sharding table_wise \\
        --out runs/torchx-demo

Resources: each replica (one host, ``nproc_per_node`` processes) asks for
``--cpu`` CPUs and ``--memMB`` MB of memory; by default, on a GPU host
(``--gpu N``), :data:`CPU_PER_GPU` CPUs and :data:`MEM_MB_PER_GPU` MB per GPU (an 8-GPU host:
48 CPUs, 256 GiB; this fits the common 4- and 8-GPU hosts, whose CPUs and memory per GPU
are larger, with room for their system daemons), and without GPUs
:data:`CPU_PER_PROCESS` CPUs and :data:`MEM_MB_PER_PROCESS` MB per process. ``-h NAME``
takes a resource torchx knows by name (``torchx.specs.named_resources``, e.g.
``aws_p4d.24xlarge``) instead of ``--cpu``/``--gpu``/``--memMB``.

Where no Docker daemon or registry is at hand (a dry run, a cluster whose image already
holds this repository): ``--workspace ""`` skips building a workspace image, which
``local_docker`` and ``kubernetes`` otherwise do from the current directory (the
``.torchxconfig`` default); ``--image`` then names the image holding this repository.

Recovery with no person: ``--max_restarts N`` lets torchrun restart the job's processes
up to N times after one fails (a killed rank), ``--max_retries N`` lets the scheduler
retry the job; with either, the training gets ``--resume auto`` (unless the arguments
already say ``--resume`` or ``--overwrite``), so each restart continues from the newest
intact checkpoint, or starts anew if none was written yet.
"""

from typing import Dict, Optional, Tuple

import torchx
from torchx import specs
from torchx.components import dist

#: CPUs per GPU a replica asks for by default (48 on an 8-GPU host).
CPU_PER_GPU = 6
#: Memory per GPU (MB) a replica asks for by default (256 GiB on an 8-GPU host).
MEM_MB_PER_GPU = 32 * 1024
#: CPUs per process a replica without GPUs asks for by default.
CPU_PER_PROCESS = 2
#: Memory per process (MB) a replica without GPUs asks for by default.
MEM_MB_PER_PROCESS = 8 * 1024


def replica_resources(j: str, gpu: int, cpu: int = 0, memMB: int = 0) -> Tuple[int, int]:
    """``(cpu, memMB)`` of one replica of ``j = {nnodes}x{nproc_per_node}`` with ``gpu``
    GPUs: the values given, else (0) per GPU (:data:`CPU_PER_GPU`, :data:`MEM_MB_PER_GPU`)
    on a GPU host, per process (:data:`CPU_PER_PROCESS`, :data:`MEM_MB_PER_PROCESS`) without.

    Example::

        >>> replica_resources("2x8", gpu=8), replica_resources("1x4", gpu=0)
        ((48, 262144), (8, 32768))
    """
    for flag, value in (("--cpu", cpu), ("--memMB", memMB), ("--gpu", gpu)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    nproc = int(j.split("x")[-1])
    units = gpu if gpu > 0 else nproc
    per_cpu, per_mem = (
        (CPU_PER_GPU, MEM_MB_PER_GPU) if gpu > 0 else (CPU_PER_PROCESS, MEM_MB_PER_PROCESS)
    )
    return cpu or per_cpu * units, memMB or per_mem * units


def train(
    *script_args: str,
    j: str = "1x2",
    cpu: int = 0,
    gpu: int = 0,
    memMB: int = 0,
    h: Optional[str] = None,
    image: str = torchx.IMAGE,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    max_restarts: int = 0,
    rdzv_port: int = 29500,
) -> specs.AppDef:
    """Distributed CowClip training: ``torchrec-cowclip train`` on every process.

    Args:
        script_args: arguments of ``torchrec-cowclip train`` (``--model``, ``--data``,
            ``--batch-size`` (global), ``--sharding``, ``--out``, ...)
        j: ``{nnodes}x{nproc_per_node}``; on GPU hosts nproc_per_node <= GPUs per host
        cpu: CPUs per replica (0: 6 per GPU on a GPU host, else 2 per process)
        gpu: GPUs per replica (0: CPU training with gloo)
        memMB: memory per replica in MB (0: 32768 per GPU on a GPU host, else 8192
            per process)
        h: a resource torchx knows by name, e.g. aws_p4d.24xlarge (overrides cpu, gpu,
            memMB)
        image: container image (local_cwd runs in the current directory)
        env: extra environment variables, e.g. NCCL_DEBUG=INFO
        max_retries: scheduler retries of a failed job
        max_restarts: torchrun restarts of the job's processes after one fails
        rdzv_port: rendezvous port on the first node (multi-node only)

    Returns:
        the torchx application definition
    """
    cpu, memMB = replica_resources(j, gpu, cpu, memMB)
    env = dict(env or {})
    args = list(script_args)
    if max_restarts:
        # torchrun reads any of its options from PET_<OPTION> (torch.distributed.run).
        env["PET_MAX_RESTARTS"] = str(max_restarts)
    if (max_restarts or max_retries) and not {"--resume", "--overwrite"} & set(args):
        args += ["--resume", "auto"]
    return dist.ddp(
        "train",
        *args,
        m="torchrec_cowclip",
        name="torchrec-cowclip",
        j=j,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        h=h,
        image=image,
        env=env,
        max_retries=max_retries,
        rdzv_port=rdzv_port,
    )
