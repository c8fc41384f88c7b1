"""What a job listens on: a single-node `bigbatch train --nproc 2` (torchrun's agent in the
`bigbatch` process, two gloo workers) listens on loopback only, and `--rdzv-endpoint
HOST:PORT` binds HOST's address, not every interface. Read from /proc, as `ss -ltnp` does:
the listening TCP sockets whose inodes the job's processes hold."""

import os
import socket

import pytest

from tests._cli import TINY, job, wait_for_checkpoint
from tests._sockets import is_loopback, listening

LONG = ["train", *TINY, "--steps", "1000000", "--checkpoint-every", "5"]


def test_address_parsing_matches_what_the_kernel_reports():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert f"127.0.0.1:{port}" in listening(os.getpid())[os.getpid()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from bigbatch.tasks.mnist1d import load_data

    path = tmp_path_factory.getbasetemp() / "xdg-cache"
    load_data(1000, 42, path / "bigbatch")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listeners_of_a_running_job(args, cache, out):
    with job([*args, "--out", str(out)], cache) as proc:
        wait_for_checkpoint(out, proc)  # rendezvous done, the workers' group up, training
        return proc.pid, listening(proc.pid)


@pytest.mark.slow  # ~12 s: a 2-worker job (test_faults checks the same on its own 2-worker job)
def test_a_single_node_job_listens_on_loopback_only(tmp_path, cache):
    launcher, held = _listeners_of_a_running_job([*LONG, "--nproc", "2"], cache,
                                                 tmp_path / "run")
    everything = [a for addresses in held.values() for a in addresses]
    assert everything and all(is_loopback(a) for a in everything), held
    # torchrun's agent (in the bigbatch process): the rendezvous store and the store it
    # shares with its workers; each worker: its gloo listener.
    assert len(held.get(launcher, [])) == 2, held
    assert len(held) == 3, held


@pytest.mark.slow  # ~10 s: a second 2-worker job
def test_an_endpoint_binds_its_own_address(tmp_path, cache):
    port = _free_port()
    launcher, held = _listeners_of_a_running_job(
        [*LONG, "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"], cache, tmp_path / "run")
    assert f"127.0.0.1:{port}" in held[launcher], held
    assert all(is_loopback(a) for addresses in held.values() for a in addresses), held


def test_a_host_name_that_resolves_to_loopback_is_refused_for_several_nodes(monkeypatch):
    import bigbatch.cli.launch as launch
    from bigbatch.errors import ConfigError

    def getaddrinfo(host, port, *a, **kw):  # Debian's `127.0.1.1 node0` in /etc/hosts
        ip = {"node0": "127.0.1.1", "10.0.0.5": "10.0.0.5"}.get(host, "127.0.0.1")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    monkeypatch.setattr(launch.socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(ConfigError, match=r"node0 resolves to 127\.0\.1\.1 \(loopback\)"):
        launch.check_endpoint("node0:29400", 5, several_nodes=True)
    launch.check_endpoint("node0:29400", 5)  # one node: loopback is what it should bind
    for fine in ("localhost:29400", "127.0.0.1:29400", "10.0.0.5:29400"):
        launch.check_endpoint(fine, 5, several_nodes=True)


def test_a_c10d_rendezvous_is_rewritten_to_the_bound_one_and_others_are_left_alone():
    from torch.distributed import run as torchrun

    from bigbatch.cli.rendezvous import BACKEND, bind_rendezvous

    parse = torchrun.get_args_parser().parse_args
    args = parse(["--standalone", "--nproc-per-node", "2", "x.py"])
    env = bind_rendezvous(args)
    assert (args.standalone, args.rdzv_backend, args.local_addr) == (False, BACKEND, "127.0.0.1")
    assert args.rdzv_endpoint == "127.0.0.1:0"
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    args = parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  "127.0.0.1:29400", "x.py"])
    bind_rendezvous(args)
    assert (args.rdzv_backend, args.local_addr) == (BACKEND, "127.0.0.1")
    args = parse(["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint",
                  "127.0.0.1:29400", "x.py"])
    assert bind_rendezvous(args) == {} and args.rdzv_backend == "static"


@pytest.mark.slow  # ~25 s: two launchers (two "nodes" on this machine) through one endpoint
def test_two_nodes_meet_at_a_bound_endpoint(tmp_path, cache):
    from tests._cli import start_cli

    port = _free_port()
    args = ["train", *TINY, "--steps", "20", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--timeout", "60", "--out",
            str(tmp_path / "run")]
    nodes = [start_cli(args, cache) for _ in range(2)]
    try:
        errs = [node.communicate(timeout=150)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait(30)
    assert [node.returncode for node in nodes] == [0, 0], [e[-2000:] for e in errs]
    assert (tmp_path / "run" / "final.pt").is_file()
