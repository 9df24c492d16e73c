"""A stage's ranks (issue 21): rank 0 (the serving process) starts ranks ``1..N-1`` itself, all join
one ``torch.distributed`` group, and the failure of any rank fails the stage at once.

Launch and rendezvous:

- rank 0 starts the workers with `multiprocessing`'s ``spawn`` (a fresh interpreter each: no CUDA
  context or threads inherited) from the thread that will outlive them (the main thread: each worker
  arms ``PR_SET_PDEATHSIG`` against its parent, `mammoth_core.runtime.die_with_parent`, so it dies
  with rank 0 whatever ends rank 0);
- rendezvous is a ``FileStore`` in a fresh ``0700`` temporary folder: no listening socket at all
  (torch's ``TCPStore`` listens on every interface, ``*:port``, without authentication; a file
  readable only by this user is local by construction and needs no port);
- gloo and NCCL bootstrap bind to the loopback interface (``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME`` = ``lo`` unless set): the ranks of one replica share one pod (one host), and
  nothing outside the pod can reach their sockets. NCCL's data path between GPUs is NVLink/PCIe/shared
  memory (hence the pod's ``/dev/shm`` volume);
- backend: NCCL for ``cuda`` (rank ``r`` on ``cuda:r``), gloo for ``cpu``. With NCCL a second,
  gloo group carries the control messages (pickled objects), so they never touch a GPU stream, and
  one eager all-reduce at join creates the NCCL communicator, so the AR runner's CUDA-graph capture
  records the layers' all-reduces (NCCL >= 2.9 supports capture) without initialising anything.

Failure, never a hang:

- every collective of the serving groups has ``timeout_s`` (`RankLaunch.timeout_s`); the world group
  used at start (loading can take minutes) has ``startup_timeout_s``;
- rank 0 watches its workers (their process sentinels) from the moment they start: a worker that
  exits makes rank 0 log the rank and exit code and end the process with `EXIT_RANK_FAILED` (the
  other workers die with it);
- a collective of the serving groups that raises (timeout, peer gone) calls the group's
  ``on_failure`` (`GroupRank.on_failure`) before anything else: rank 0 ends the stage as above, a
  worker exits with `EXIT_RANK_FAILED` (which rank 0 then sees). Kubernetes (or ``mammoth up``) sees
  the stage die and restarts it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from mammoth_core.distributed import GroupRank

__all__ = ["EXIT_RANK_FAILED", "JoinedRanks", "RankGroup", "RankLaunch", "backend_for", "join_ranks"]

logger = logging.getLogger(__name__)

#: Exit status of a stage process whose rank group broke (a rank died, a collective failed).
EXIT_RANK_FAILED = 3


def backend_for(device: str) -> str:
    """``nccl`` for a CUDA device, ``gloo`` otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


@dataclasses.dataclass(frozen=True)
class RankLaunch:
    """What one rank needs to join its group (picklable; given to each spawned worker).

    Attributes:
        rank, world_size: this rank, ranks in all (rank 0 is the serving process).
        store_path: the ``FileStore`` file of the rendezvous.
        device: ``cpu`` or ``cuda``; rank ``r`` uses ``cuda:r``.
        timeout_s: seconds any collective of the serving groups may wait.
        startup_timeout_s: seconds the rendezvous and the after-load barrier may wait.
        name: the stage (``ar``, ``dit``) for logs and process names.
    """

    rank: int
    world_size: int
    store_path: str
    device: str
    timeout_s: float
    startup_timeout_s: float
    name: str

    @property
    def rank_device(self) -> str:
        """This rank's device: ``cuda:<rank>`` or ``cpu``."""
        return f"cuda:{self.rank}" if backend_for(self.device) == "nccl" else "cpu"


@dataclasses.dataclass(frozen=True)
class JoinedRanks:
    """A rank's handles once joined: ``data`` for tensors (NCCL or gloo), ``control`` for pickled
    objects (gloo; the same group as ``data`` on CPU)."""

    launch: RankLaunch
    data: GroupRank
    control: GroupRank

    def barrier(self) -> None:
        """Wait for every rank (world group, ``startup_timeout_s``): used once all have loaded."""
        dist.barrier()

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled, over the control group)."""
        return self.control.broadcast_object(obj)


def _set_loopback_interfaces() -> None:
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, "lo")
    # NCCL's cuMem buffers cost 1-2 GiB per GPU once all-reduces are captured in CUDA graphs
    # (NVIDIA/nccl#1234; vLLM sets the same); a single node needs none of what they enable.
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def exit_rank_failed(reason: str) -> None:
    """A worker's reaction to a failed collective: log it and end the process (`EXIT_RANK_FAILED`)."""
    logger.critical("%s; this rank exits", reason)
    logging.shutdown()
    os._exit(EXIT_RANK_FAILED)


def join_ranks(launch: RankLaunch, on_failure: Callable[[str], None] = exit_rank_failed) -> JoinedRanks:
    """Join the group of ``launch`` (every rank calls it; blocks until all have). A collective of the
    serving groups that raises calls ``on_failure`` first (default: end this process).

    Raises:
        RuntimeError / DistBackendError: the rendezvous timed out or a rank failed meanwhile.
    """
    _set_loopback_interfaces()
    backend = backend_for(launch.device)
    if backend == "nccl":
        torch.cuda.set_device(launch.rank)
    store = dist.FileStore(launch.store_path, launch.world_size)
    store.set_timeout(datetime.timedelta(seconds=launch.startup_timeout_s))
    kwargs = {"device_id": torch.device(launch.rank_device)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                            timeout=datetime.timedelta(seconds=launch.startup_timeout_s), **kwargs)
    timeout = datetime.timedelta(seconds=launch.timeout_s)
    data_group = dist.new_group(list(range(launch.world_size)), timeout=timeout, backend=backend)
    control_group = data_group if backend == "gloo" else dist.new_group(
        list(range(launch.world_size)), timeout=timeout, backend="gloo")
    data = GroupRank(launch.rank, launch.world_size, data_group, on_failure)
    control = GroupRank(launch.rank, launch.world_size, control_group, on_failure)
    if backend == "nccl":  # the communicator exists before any CUDA graph capture records its collectives
        data.all_reduce_(torch.zeros(1, device=launch.rank_device))
        torch.cuda.synchronize()
    logger.info("%s rank %d/%d joined (%s)", launch.name, launch.rank, launch.world_size, backend)
    return JoinedRanks(launch, data, control)


def _worker_main(target: Callable[[RankLaunch, Any], None], launch: RankLaunch, payload: Any,
                 parent_pid: int, log_format: str, log_level: str) -> None:
    """A spawned worker: die with rank 0, then run ``target``; any exception exits non-zero."""
    from mammoth_core.logging import setup_logging
    from mammoth_core.runtime import die_with_parent

    die_with_parent(parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 alone handles signals and stops the others
        signal.signal(sig, signal.SIG_IGN)
    setup_logging(f"{launch.name}-rank{launch.rank}", log_format, log_level)
    try:
        target(launch, payload)
    except BaseException:  # noqa: BLE001 - reported, then the exit status says it
        logger.exception("%s rank %d failed", launch.name, launch.rank)
        logging.shutdown()
        os._exit(EXIT_RANK_FAILED)
    logging.shutdown()
    os._exit(0)


class RankGroup:
    """Rank 0's side of a stage's ranks: the spawned workers, the watch on them, shutdown.

    Use `RankGroup.spawn` (from the main thread; it starts watching the workers), then `join` (any
    thread; blocks until every rank joined); `close` at shutdown.
    """

    def __init__(self, launches: list[RankLaunch], procs: list[multiprocessing.Process], folder: str,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.launches = launches
        self.procs = procs
        self._folder = folder
        self._closing = threading.Event()
        self._on_failure = on_failure or self.fail
        self.joined: JoinedRanks | None = None

    @classmethod
    def spawn(cls, name: str, world_size: int, device: str, target: Callable[[RankLaunch, Any], None],
              payload: Any, *, timeout_s: float, startup_timeout_s: float, log_format: str = "text",
              log_level: str = "warning", on_failure: Callable[[str], None] | None = None) -> RankGroup:
        """Start ranks ``1..world_size-1`` running ``target(launch, payload)`` (a module-level
        function; ``payload`` picklable) and watch them from now on (`watch`). Call from the main
        thread (see the module docstring).

        Raises:
            ValueError: ``world_size`` below 2, or more CUDA ranks than visible GPUs.
        """
        if world_size < 2:
            raise ValueError(f"a rank group needs 2 ranks or more, got {world_size}")
        if backend_for(device) == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(f"{world_size} ranks need {world_size} GPUs; {torch.cuda.device_count()} visible")
        _set_loopback_interfaces()
        folder = tempfile.mkdtemp(prefix=f"mammoth-{name}-ranks-")  # mode 0700
        launches = [RankLaunch(r, world_size, os.path.join(folder, "store"), device, timeout_s,
                               startup_timeout_s, name) for r in range(world_size)]
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_worker_main, name=f"mammoth-{name}-rank{r}", daemon=True,
                             args=(target, launches[r], payload, os.getpid(), log_format, log_level))
                 for r in range(1, world_size)]
        for proc in procs:
            proc.start()
        logger.info("%s: started ranks 1..%d (pids %s)", name, world_size - 1, [p.pid for p in procs])
        group = cls(launches, procs, folder, on_failure)
        group.watch()  # a worker dying while the others load or wait in the rendezvous fails at once too
        return group

    def join(self) -> JoinedRanks:
        """Join as rank 0 (blocks until every worker joined or ``startup_timeout_s``)."""
        self.joined = join_ranks(self.launches[0], self._on_failure)
        return self.joined

    def watch(self) -> None:
        """From now on a worker that exits fails the stage (`fail`), unless `close` began (`spawn`
        calls it)."""
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing.is_set():
            return
        proc = sentinels[ready[0]]
        proc.join(1)
        self._on_failure(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}")

    def fail(self, reason: str) -> None:
        """End the stage now: log ``reason``, kill the workers, exit with `EXIT_RANK_FAILED`."""
        logger.critical("rank group of %s failed: %s; the stage exits", self.launches[0].name, reason)
        self._kill_workers()
        logging.shutdown()
        os._exit(EXIT_RANK_FAILED)

    def _kill_workers(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def close(self, timeout_s: float = 10.0) -> None:
        """Normal shutdown: stop watching, wait up to ``timeout_s`` for the workers to exit (the
        stage told them to stop), kill what is left, remove the rendezvous folder."""
        self._closing.set()
        for proc in self.procs:
            proc.join(timeout_s)
        self._kill_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._folder, ignore_errors=True)
