"""`radixlm-server --ray-address ADDR --dp-size N`: the replicas placed on a Ray cluster.

Ray does the placement only; serving stays what it is on one machine. Each replica gets a
placement group of its own, one bundle of CPUs per tensor-parallel rank, packed on one node
(STRICT_PACK: the ranks of a replica talk over gloo/NCCL, which wants them together). A Ray actor in
the group's first bundle supervises the replica's server process (router/replicas.py
ReplicaProcess: started again when it dies), bound to its node's IP address so the router in this
process reaches it over TCP. Requests never travel through Ray: only the actors' control calls do.
"""

from __future__ import annotations

import signal
from typing import Any

from radixlm_runtime.router.replicas import (
    STARTUP_TIMEOUT_S,
    ReplicaProcess,
    free_port,
    replica_argv,
    replica_flags,
)
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger

logger = get_logger("radixlm_runtime.router.ray_replicas")

INSTALL = "pip install 'radixlm[ray]'"


def require_ray() -> Any:
    """The ray module, or a RuntimeError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray-address needs Ray, an optional extra: {INSTALL}") from None
    return ray


class ReplicaActor:
    """Runs in a Ray worker on the replica's node: owns its server process."""

    def __init__(self, argv: list[str], shutdown_timeout: float) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        self.replica = ReplicaProcess(argv, host, free_port(host), shutdown_timeout)

    def start(self) -> str:
        self.replica.wait_healthy()
        return self.replica.url

    def pid(self) -> int:
        """The server process's pid (it changes when the process is started again)."""
        return self.replica.pid

    def stop(self) -> int:
        self.replica.terminate()
        return self.replica.wait()


class RayReplicas:
    """The --dp-size replicas as Ray actors, one placement group each (router/replicas.ReplicaSet)."""

    def __init__(self, args: ServerArgs, argv: list[str]) -> None:
        self.ray = require_ray()
        self.args = args
        self.argv = replica_argv(argv)
        self.actors: list[Any] = []
        self.groups: list[Any] = []

    def _bundles(self) -> list[dict[str, float]]:
        """One bundle per tensor-parallel rank of a replica, each the CPUs its kernels use."""
        cpus = float(self.args.engine.num_threads or 1)
        return [{"CPU": cpus}] * self.args.engine.tp_size

    def start(self) -> list[str]:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        address = self.args.server.ray_address
        on_sigterm = signal.getsignal(signal.SIGTERM)
        ray.init(address=address, logging_level="WARNING", log_to_driver=True)
        signal.signal(signal.SIGTERM, on_sigterm)  # ray.init's own handler exits 15 without the drain
        bundles = self._bundles()
        actor_cls = ray.remote(ReplicaActor)
        for i in range(self.args.server.dp_size):
            group = placement_group(bundles, strategy="STRICT_PACK", name=f"radixlm-replica-{i}")
            self.groups.append(group)
            try:
                ray.get(group.ready(), timeout=STARTUP_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"the Ray cluster at {address} could not place replica {i}: it needs {bundles} on one "
                    "node (see `ray status`)"
                ) from None
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
            actor = actor_cls.options(
                num_cpus=bundles[0]["CPU"], scheduling_strategy=strategy, max_concurrency=4
            ).remote([*self.argv, *replica_flags(self.args, i)], self.args.server.shutdown_timeout)
            self.actors.append(actor)
        try:
            urls = ray.get([a.start.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a replica failed to start on the Ray cluster: {e}") from None
        logger.info("replicas on the Ray cluster at %s: %s", address, ", ".join(urls))
        return urls

    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def stop(self) -> None:
        """Drains every replica, then takes its actor and placement group off the cluster (the
        cluster itself is the operator's and keeps running)."""
        ray = self.ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        try:
            stops = [a.stop.remote() for a in self.actors]
            codes = ray.get(stops, timeout=self.args.server.shutdown_timeout + 60)
            logger.info("replicas exited with codes %s", codes)
        except Exception as e:  # an actor already gone: its process went with it (PDEATHSIG)
            logger.warning("stopping the replicas: %s", e)
        for actor in self.actors:
            ray.kill(actor)
        for group in self.groups:
            remove_placement_group(group)
        ray.shutdown()
