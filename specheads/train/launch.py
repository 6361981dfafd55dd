"""The recipe's `launch:` section (the cluster's topology) and the `accelerate launch` line it stands for.

`specheads launch --config RECIPE --node-rank N -- train` runs the same command on every node; this module turns
the section into accelerate's own launcher arguments (torchrun underneath: static rendezvous at node 0's
main_process_ip:main_process_port). Nothing here starts processes itself: commands/launch.py execs accelerate.
"""
from __future__ import annotations

import ipaddress
import socket
import sys
import time
from dataclasses import dataclass

from specheads.utils import SpecheadsError, check_values

BACKENDS = ("nccl", "gloo")  # nccl: one process per GPU; gloo: CPU processes (ACCELERATE_USE_CPU)


@dataclass
class LaunchConfig:
    num_machines: int = 1  # nodes; each runs the same command with its own --node-rank (0 = the main node)
    num_processes_per_machine: int = 1  # training processes per node (one per GPU with nccl)
    main_process_ip: str | None = None  # node 0's address as the other nodes reach it (--main-ip overrides it)
    main_process_port: int = 29500  # TCP port on node 0 for the rendezvous; must be open between the nodes
    backend: str = "nccl"  # nccl (GPUs) | gloo (CPU processes, e.g. a loopback test)
    timeout_s: int = 300  # seconds a node waits for node 0 to listen (and the rendezvous for every node)

    def __post_init__(self) -> None:
        check_values("launch", self, {"num_machines": ">=1", "num_processes_per_machine": ">=1",
                                      "main_process_port": "[1,65536)", "timeout_s": ">=1"})
        if self.backend not in BACKENDS:
            raise SpecheadsError(f"launch.backend: {self.backend!r} is not one of {list(BACKENDS)}")
        if self.main_process_ip is not None:
            check_address(self.main_process_ip, "launch.main_process_ip")


def check_address(ip: str, where: str) -> None:
    """An IPv4/IPv6 address or a host name (letters, digits, '-', '.'), nothing else (no port, no scheme)."""
    try:
        ipaddress.ip_address(ip)
        return
    except ValueError:
        pass
    ok = 0 < len(ip) <= 253 and all(p and len(p) <= 63 and p.replace("-", "").isalnum() for p in ip.split("."))
    if not ok:
        raise SpecheadsError(f"{where}: {ip!r} is not an address or host name (write e.g. 10.0.0.1, without a port: "
                             f"the port is launch.main_process_port)")


def accelerate_argv(cfg: LaunchConfig, node_rank: int, main_ip: str | None, mixed_precision: str,
                    command: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of `accelerate launch` for this node: every process count and address is explicit,
    so an accelerate default config file (~/.cache/huggingface/accelerate) changes nothing it sets."""
    if not 0 <= node_rank < cfg.num_machines:
        raise SpecheadsError(f"--node-rank {node_rank}: out of range for launch.num_machines {cfg.num_machines} "
                             f"(0..{cfg.num_machines - 1}; 0 is the main node)")
    if main_ip is not None:
        check_address(main_ip, "--main-ip")
    ip = main_ip or cfg.main_process_ip
    if ip is None and cfg.num_machines > 1:
        raise SpecheadsError(f"launch.main_process_ip: not set, and launch.num_machines is {cfg.num_machines}: "
                             f"give node 0's address in the recipe or with --main-ip")
    total = cfg.num_machines * cfg.num_processes_per_machine  # accelerate counts the processes of all nodes
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", str(cfg.num_machines),
            "--machine_rank", str(node_rank), "--num_processes", str(total),
            "--main_process_ip", ip or "127.0.0.1", "--main_process_port", str(cfg.main_process_port),
            "--mixed_precision", mixed_precision, "--dynamo_backend", "no"]
    if cfg.num_machines > 1:  # static rendezvous at node 0; its wait for the other nodes ends after timeout_s
        argv += ["--rdzv_backend", "static", "--rdzv_conf", f"timeout={cfg.timeout_s}"]
    if total > 1:
        argv.append("--multi_gpu")  # torchrun; with gloo the processes run on the CPU (ACCELERATE_USE_CPU below)
    env = {"ACCELERATE_USE_CPU": "true"} if cfg.backend == "gloo" else {}
    return argv + ["-m", "specheads", *command], env


def check_port_free(port: int) -> None:
    """On node 0 before the launch: the rendezvous port is free (else one line, not torchrun's traceback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise SpecheadsError(f"launch.main_process_port {port}: cannot listen on this node ({e.strerror}): "
                                 f"another run holds it; choose another port in the recipe") from None


def wait_for_main(ip: str, port: int, timeout_s: float, poll_s: float = 1.0) -> float:
    """On nodes 1..N-1: wait until node 0 listens at ip:port (its launcher opens the port when it starts); the
    seconds waited, or one SpecheadsError after timeout_s (node 0 not started, a firewall, a wrong address)."""
    t0 = time.monotonic()
    last = "no answer"
    while True:
        try:
            with socket.create_connection((ip, port), timeout=min(5.0, timeout_s)):
                return time.monotonic() - t0
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() - t0 + poll_s > timeout_s:
            raise SpecheadsError(f"cannot reach the main node at {ip}:{port} within {timeout_s:g} s "
                                 f"(launch.timeout_s; last: {last}): start node 0 first, open port {port} between "
                                 f"the nodes, or check launch.main_process_ip / --main-ip")
        time.sleep(poll_s)
